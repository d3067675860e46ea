"""CUDA: the vLLM worker's KV source as :func:`cluster.vllm.worker_source.build_worker_source`
builds it (pinned staging, one copy and one event per layer), under the blend engine:

* ratio 1.0 through the source equals full prefill, from the gpu, host and disk tiers, and the
  layers it delivers are bit-exact;
* a copy made slow on the copy stream: the engine gets layers whose copy is still in flight
  (their ``ready`` event not yet complete) and the result is still the fast source's, bit for
  bit: the compute stream waits on each layer's own event.

Needs a GPU (skipped otherwise); collects without vLLM, Ray, Redis or boto3.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from blend import engine as engine_module
from blend import ops
from blend.engine import BlendEngine
from cluster.cache.local import LocalCacheClient
from cluster.vllm.worker_source import build_worker_source
from tests.factories import F32_TOL, all_hit_plan, ops_adapter, random_chunks
from tiers.disk import DiskTier
from tiers.host import HostTier
from tiers.keys import segment_key
from tiers.staging import StagedSource

# skipped without CUDA by the gpu marker (tests/conftest.py), test by test: a module-level skip
# would be reported once by every lane's process
pytestmark = [pytest.mark.gpu, pytest.mark.unit]
CUDA = torch.device("cuda")
NAMESPACE = "0123456789abcdef"


def _sources(tmp_path, adapter, chunks):
    """gpu / host / disk sources, each built by the product's builder."""
    host = LocalCacheClient(HostTier(1 << 28), device=CUDA)
    disk = LocalCacheClient(DiskTier(str(tmp_path), 1 << 28, fsync=False), device=CUDA)
    num_layers = adapter.spec.num_layers
    sources = {"gpu": build_worker_source(host, CUDA, num_layers, gpu_bytes=1 << 28),
               "host": build_worker_source(host, CUDA, num_layers),
               "disk": build_worker_source(disk, CUDA, num_layers)}
    engine = BlendEngine(adapter)
    kvs = {}
    for ids in chunks:
        key = segment_key(NAMESPACE, ids)
        kvs[key] = torch.stack(engine.prefill(ids, want_logits=False).kv)  # [L, 2, T, H, D]
        host.put(key, kvs[key])
        disk.put(key, kvs[key])
        sources["gpu"].remember(key, kvs[key])
    return sources, kvs


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "causal_attention", ops.causal_attention)
    adapter = ops_adapter(CUDA, hidden=128, heads=4, kv_heads=2, vocab=256)  # head_dim 32
    chunks = random_chunks(4, 160, vocab=256, low=4)
    sources, kvs = _sources(tmp_path, adapter, chunks)
    yield adapter, chunks, sources, kvs
    for src in sources.values():
        src.close()


def test_built_source_stages_on_cuda_and_ratio_one_is_full_prefill(setup):
    adapter, chunks, sources, kvs = setup
    assert isinstance(sources["host"].reader, StagedSource) and isinstance(sources["disk"].reader, StagedSource)
    keys = list(kvs)
    plan = all_hit_plan(chunks, 1.0)
    full = BlendEngine(adapter).prefill(list(plan.token_ids))
    for tier, src in sources.items():
        for layer, fut in enumerate(src.fetch_layers(keys, range(adapter.spec.num_layers))):
            got = fut.result(timeout=60)
            ready = getattr(got, "ready", None)
            if ready is not None:
                ready.synchronize()
            assert all(torch.equal(g, kvs[k][layer]) for g, k in zip(got, keys, strict=True)), (tier, layer)
        res = BlendEngine(adapter, src).blend(plan)
        assert res.counters.full_prefill_reason is None, tier
        torch.testing.assert_close(res.logits, full.logits, **F32_TOL)
        for a, b in zip(res.kv, full.kv, strict=True):
            torch.testing.assert_close(a, b, **F32_TOL)
    assert sources["host"].reader.transfer_stats().num_bytes > 0
    # used twice now: the host source pins the chunks (registered memory) and reads them
    # from there, still exact
    pinned = sources["host"].reader.pinned
    assert pinned.wait_idle(60) and pinned.stats()["num_chunks"] == len(keys), pinned.stats()
    res = BlendEngine(adapter, sources["host"]).blend(plan)
    torch.testing.assert_close(res.logits, full.logits, **F32_TOL)


def test_compute_stream_waits_on_each_layers_copy_event(setup, monkeypatch):
    adapter, chunks, sources, _ = setup
    plan = all_hit_plan(chunks, 0.15)
    want = BlendEngine(adapter, sources["gpu"]).blend(plan)

    staged = sources["host"].reader
    real_stage = StagedSource._stage

    busy = torch.randn(4096, 4096, device=CUDA)
    torch.cuda.synchronize()

    def slow_stage(self, *args):
        with torch.cuda.stream(self._copy_stream):  # ~10+ ms of device work ahead of the copy
            for _ in range(40):
                torch.mm(busy, busy)
        return real_stage(self, *args)

    monkeypatch.setattr(StagedSource, "_stage", slow_stage)
    in_flight = []  # per layer the engine took: was its copy still running at that moment?
    real_fetch = sources["host"].fetch_layers

    class Probe(Future):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def result(self, timeout=None):
            got = self.inner.result(timeout)
            ready = getattr(got, "ready", None)
            in_flight.append(ready is not None and not ready.query())
            return got

        def cancel(self):
            return self.inner.cancel()

    monkeypatch.setattr(sources["host"], "fetch_layers",
                        lambda keys, layer_idxs: [Probe(f) for f in real_fetch(keys, layer_idxs)])
    got = BlendEngine(adapter, sources["host"]).blend(plan)
    assert got.counters.full_prefill_reason is None
    assert any(in_flight), "no layer reached the engine before its copy completed: nothing was tested"
    assert torch.equal(got.recompute_idx, want.recompute_idx)
    assert torch.equal(got.logits, want.logits)
    for a, b in zip(got.kv, want.kv, strict=True):
        assert torch.equal(a, b)
    assert staged.transfer_stats().num_copies >= adapter.spec.num_layers - 1


def test_query_attention_through_the_staged_source_on_cuda(setup):
    """Issue 17 on CUDA: ``query_attention`` through the worker's staged host source equals
    full prefill at ratio 1.0, and at ratio 0.15 recomputes the same rows as the same model
    on the CPU (the ranking does not depend on the device)."""
    import dataclasses

    adapter, chunks, sources, kvs = setup
    full = BlendEngine(adapter).prefill(list(all_hit_plan(chunks, 1.0).token_ids))
    plan = dataclasses.replace(all_hit_plan(chunks, 1.0), selection="query_attention", sink_tokens=4)
    res = BlendEngine(adapter, sources["host"]).blend(plan)
    assert res.counters.selection == "query_attention" and res.counters.full_prefill_reason is None
    torch.testing.assert_close(res.logits, full.logits, **F32_TOL)
    plan = dataclasses.replace(plan, recompute_ratios=(0.15,), probe_layers=(0, 1))
    res = BlendEngine(adapter, sources["host"]).blend(plan)
    assert res.counters.probe_s > 0 and res.counters.full_prefill_reason is None
    assert torch.isfinite(res.logits).all()
    cpu_adapter = ops_adapter("cpu", hidden=128, heads=4, kv_heads=2, vocab=256)
    cpu_adapter.model.load_state_dict({k: v.cpu() for k, v in adapter.model.state_dict().items()})
    cpu_client = LocalCacheClient(HostTier(1 << 28))
    for key, kv in kvs.items():
        cpu_client.put(key, kv.cpu())
    cpu = BlendEngine(cpu_adapter, cpu_client).blend(plan)
    assert cpu.counters.selected_tokens == res.counters.selected_tokens
    same = len(set(cpu.recompute_idx.tolist()) & set(res.recompute_idx.cpu().tolist()))
    assert same >= 0.95 * res.recompute_idx.numel(), (same, res.recompute_idx.numel())
