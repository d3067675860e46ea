"""The worker half reports each request's load in ``finished_recving`` exactly once (vLLM PR
#51595: a request reported finished twice had its blocks freed twice), whether the load ran to
its end or vLLM finished (aborted) the request while it was in flight, and however often vLLM
names the request in ``finished_req_ids`` afterwards. No model: the loads are generators that
stand in for :meth:`blend.engine.BlendEngine.blend_steps`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cluster.vllm.events import EventLog, WarnOnce, read_events
from cluster.vllm.metadata import LoadSpec
from cluster.vllm.metrics import Counters
from cluster.vllm.paged import ClaimedLayerWrites
from cluster.vllm.worker import KVBlendWorker, _LoadRun

pytestmark = pytest.mark.unit

_COUNTERS = SimpleNamespace(num_segments=2, num_hit_segments=2, reused_tokens=8, computed_tokens=4,
                            selected_tokens=1, selection="k_deviation", selection_fallback=None, probe_s=0.0,
                            recomputed_tokens_per_layer=[1], load_wait_s=0.0, compute_s=0.0, transfer_s=0.0,
                            transfer_busy_s=None,
                            full_prefill_reason=None)


def _steps(layers: int):
    for _ in range(layers):
        yield
    return SimpleNamespace(counters=_COUNTERS)


def _run(rid: str, layers: int) -> _LoadRun:
    spec = LoadSpec(rid, 0, 4, torch.arange(4), [0], 16, load_async=True)
    return _LoadRun(spec, {"request_id": rid}, _steps(layers), ClaimedLayerWrites(0, 4, spec.slot_mapping, None), 0.0)


def test_each_load_is_reported_finished_once(tmp_path):
    path = str(tmp_path / "events.jsonl")
    worker = KVBlendWorker(None, None, model_id="m", store_tokens_per_step=512, load_step_s=0.0,
                           counters=Counters(), events=EventLog(path), warn=WarnOnce())
    worker._loads["done"] = _run("done", 2)
    worker._loads["aborted"] = _run("aborted", 1000)
    try:
        for _ in range(3):  # one layer a step (load_step_s 0), oldest first: "done" ends
            assert worker.get_finished(set()) == (None, None)
            worker._advance_async(idle=False)
        assert list(worker._loads) == ["aborted"]
        assert worker.get_finished(set()) == (None, {"done"})
        assert worker.get_finished({"done"}) == (None, None)  # vLLM finishes it later: not again

        assert worker.get_finished({"aborted"}) == (None, {"aborted"})  # in flight: abandoned once
        assert not worker._loads
        worker._advance_async(idle=True)
        for finished in ({"aborted"}, {"aborted", "done"}, set()):
            assert worker.get_finished(finished) == (None, None)
    finally:
        worker.shutdown()
    loads = [e for e in read_events(path) if e["event"] == "load"]
    assert [(e["request_id"], e.get("aborted", False)) for e in loads] == [("done", False), ("aborted", True)]
