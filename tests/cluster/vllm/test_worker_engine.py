"""The worker's engine build (:func:`cluster.vllm.worker_engine.build_worker_engine`) with its
parts stubbed: the order of the start-up steps, and a failure after the source was built
closes it (its staging threads and pinned memory) and raises."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import blend.adapters.vllm as vllm_adapters
import blend.engine as engine_module
import cluster.vllm.model_hook as model_hook
import cluster.vllm.worker_engine as worker_engine
import cluster.vllm.worker_source as worker_source

pytestmark = pytest.mark.unit


class _Source:
    closed = 0

    def close(self):
        self.closed += 1


def _config(probe_graph_tokens=0):
    return SimpleNamespace(
        blend=SimpleNamespace(compile_layers=False, load_timeout_s=1.0, flex_warm_tokens=0,
                              probe_graph_tokens=probe_graph_tokens, selection="query_attention",
                              probe_layers="all"),
        tiers=SimpleNamespace(gpu_size_gib=0, eviction_policy="lru", pinned_size_gib=0))


@pytest.fixture
def stubbed(monkeypatch):
    source = _Source()
    adapter = SimpleNamespace(device=torch.device("cpu"), spec=SimpleNamespace(num_layers=2, max_position=64))
    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(model_hook, "current_model", lambda: model)
    monkeypatch.setattr(vllm_adapters, "vllm_adapter", lambda m, model_id, compile: adapter)
    monkeypatch.setattr(worker_source, "build_worker_source", lambda *a, **k: source)
    return source, adapter


def test_off_cuda_the_engine_and_its_source_come_back_without_start_up_work(stubbed, monkeypatch):
    source, adapter = stubbed
    built = []
    monkeypatch.setattr(engine_module, "BlendEngine", lambda a, s, load_timeout_s: built.append((a, s)) or "engine")
    monkeypatch.setattr(worker_engine, "calibration_samples", lambda *a: pytest.fail("calibrated off CUDA"))
    engine, got, samples = worker_engine.build_worker_engine(_config(), client=None, model_id="m")
    assert (engine, got) == ("engine", source) and built == [(adapter, source)] and not samples
    assert source.closed == 0


def test_a_failure_after_the_source_was_built_closes_it(stubbed, monkeypatch):
    source, _ = stubbed

    def refuse(*args, **kwargs):
        raise ValueError("probe layers the model lacks")

    monkeypatch.setattr(engine_module, "BlendEngine", refuse)
    with pytest.raises(ValueError, match="probe layers"):
        worker_engine.build_worker_engine(_config(), client=None, model_id="m")
    assert source.closed == 1


def test_probe_layers_the_model_lacks_leave_the_graphs_off_not_the_engine(caplog):
    """The probe's graphs are on by default: layers outside the model are logged and the
    worker keeps its engine (each blend then raises and recovers by full prefill)."""
    adapter = SimpleNamespace(device=torch.device("cpu"), spec=SimpleNamespace(num_layers=2, max_position=64))
    config = SimpleNamespace(selection="query_attention", probe_layers=(0, 5))
    with caplog.at_level("WARNING", logger="kvblend.connector"):
        assert worker_engine.build_probe_graphs(config, adapter, 1.0, 64) is None
    assert "outside the model" in caplog.text
    assert worker_engine.build_probe_graphs(SimpleNamespace(selection="k_deviation", probe_layers=()), adapter,
                                            1.0, 64) is None  # no probe: no graphs
