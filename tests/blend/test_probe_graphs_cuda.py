"""CUDA: the query probe's captured per-layer graphs (:mod:`blend.probe_graphs`) against the
eager probe over the staged host->GPU source, with the adapter a vLLM worker computes with
(:class:`blend.adapters.fused_layers.FusedLlamaLayers`, compiled) and the plain HF adapter.
Skipped without a GPU; the bookkeeping is tested on CPU in ``test_probe_graphs.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from blend import engine as engine_module
from blend import ops
from blend.engine import BlendEngine
from blend.probe_graphs import ProbeGraphs
from blend.query_selection import probe_layers_for
from tests.factories import (
    F32_TOL,
    all_hit_plan,
    fill_tiers,
    ops_adapter,
    random_chunks,
    tiny_model,
)
from tiers.host import HostTier
from tiers.staging import StagedSource

pytestmark = [pytest.mark.gpu, pytest.mark.unit]
CUDA = torch.device("cuda")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(params=["fused", "hf"])
def adapter(request):
    if request.param == "hf":
        return ops_adapter(CUDA, hidden=128, heads=4, kv_heads=2, vocab=256, num_layers=6)
    from blend.adapters.fused_llama import FusedLlamaAdapter

    model = tiny_model("llama", hidden=128, heads=4, kv_heads=2, vocab=256, num_layers=6, max_position=4096)
    fused = FusedLlamaAdapter(model.to(CUDA), model_id="tiny-llama", compile=True)
    fused.warm_up()
    return fused


def _plan(chunks, ratio=0.15, query=(5, 6, 7, 8)):
    return dataclasses.replace(all_hit_plan(chunks, ratio, query=query), selection="query_attention", sink_tokens=4)


def _same(got, want):
    assert got.counters.full_prefill_reason is None
    assert got.recompute_idx.tolist() == want.recompute_idx.tolist()
    torch.testing.assert_close(got.logits, want.logits, **F32_TOL)
    for a, b in zip(got.kv, want.kv, strict=True):
        torch.testing.assert_close(a, b, **F32_TOL)


def _engines(adapter, monkeypatch, max_tokens: int, seed: int = 1):
    """Six 160-token chunks in a host tier read through the staged source; the eager engine,
    one with the probe's graphs (none prepared yet), the graphs and the source."""
    monkeypatch.setattr(engine_module, "causal_attention", ops.causal_attention)
    chunks = random_chunks(6, 160, vocab=256, low=4, seed=seed)
    host = HostTier(1 << 28)
    fill_tiers(BlendEngine(adapter), chunks, [host])
    src = StagedSource(host, CUDA)
    eager = BlendEngine(adapter, src)
    graphs = ProbeGraphs(adapter, eager.scale, max_tokens=max_tokens)
    return chunks, eager, BlendEngine(adapter, src, probe_graphs=graphs), graphs, src


def test_replayed_probe_layers_give_the_eager_blend(adapter, monkeypatch):
    chunks, eager, fast, graphs, src = _engines(adapter, monkeypatch, max_tokens=2048)
    plans = [_plan(chunks[:4]), _plan(chunks[1:5], query=(9, 10, 11)), _plan(chunks, ratio=0.3), _plan(chunks, 1.0)]
    layers = probe_layers_for((), adapter.spec.num_layers)
    for p in plans[:2]:  # two prompts of one bucket (4 chunks), then a longer one (6)
        src.lookup([s.key for s in p.hit_segments])
    assert graphs.prepare(12, plans[0].blend_end, layers), graphs.broken
    assert graphs.prepare(12, plans[2].blend_end, layers), graphs.broken
    assert graphs.stats()["buckets"] == [[128, 768], [128, 1024]]
    graphs._staging.fill_(float("nan"))  # noqa: SLF001 - pad keys must be zeroed per request
    for plan in plans[:3]:
        src.lookup([s.key for s in plan.hit_segments])
        _same(fast.blend(plan), eager.blend(plan))
    assert graphs.layer_runs == 3 * (layers[-1] + 1)
    src.lookup([s.key for s in plans[3].hit_segments])
    got, full = fast.blend(plans[3]), BlendEngine(adapter).prefill(list(plans[3].token_ids))
    torch.testing.assert_close(got.logits, full.logits, **F32_TOL)  # ratio 1.0: full prefill
    src.close()


def _miss(plan, index: int):
    """``plan`` with its ``index``-th chunk a miss (computed with the new tokens)."""
    chunks = [i for i, s in enumerate(plan.segments) if s.kind == "chunk"]
    segments = list(plan.segments)
    s = segments[chunks[index]]
    segments[chunks[index]] = dataclasses.replace(s, hit=False, stored_positions=())
    return dataclasses.replace(plan, segments=tuple(segments))


def test_buckets_the_worker_prepares_serve_prompts_with_missed_chunks(adapter, monkeypatch):
    """``prepare_all`` (the vLLM worker's start-up capture) then prompts whose missed chunks
    leave the probe fewer keys than the prompt has: each equals the eager blend, and ratio 1.0
    with a miss is still full prefill."""
    chunks, eager, fast, graphs, src = _engines(adapter, monkeypatch, max_tokens=1200, seed=5)
    layers = probe_layers_for((), adapter.spec.num_layers)
    assert graphs.prepare_all(layers) > 0 and graphs.broken is None, graphs.broken
    assert [128, 1536] in graphs.stats()["buckets"] and [256, 1536] in graphs.stats()["buckets"]
    plans = [_miss(_plan(chunks), 1), _miss(_miss(_plan(chunks[:5], ratio=0.3), 0), 3), _miss(_plan(chunks), 5)]
    runs = 0
    for plan in plans:
        src.lookup([s.key for s in plan.hit_segments])
        _same(fast.blend(plan), eager.blend(plan))
        runs += layers[-1] + 1
        assert graphs.layer_runs == runs  # the bucket ran, not the eager probe
    full_plan = _miss(_plan(chunks, 1.0), 2)
    src.lookup([s.key for s in full_plan.hit_segments])
    got, full = fast.blend(full_plan), BlendEngine(adapter).prefill(list(full_plan.token_ids))
    torch.testing.assert_close(got.logits, full.logits, **F32_TOL)
    src.close()


def test_more_buckets_keep_little_device_memory():
    """Every bucket's warm-up runs on one stream: cuBLAS keeps a workspace per stream (32 MiB
    on Hopper), and a stream per bucket had kept ~0.7-1 GB for a 7B-shaped model's buckets
    (docs/benchmarks.md). A bucket of this tiny model adds well under 1 MiB of its own."""
    model = ops_adapter(CUDA, hidden=128, heads=4, kv_heads=2, vocab=256, num_layers=4)
    graphs = ProbeGraphs(model, BlendEngine(model).scale, max_tokens=4096)
    layers = probe_layers_for((), model.spec.num_layers)
    assert graphs.prepare(12, 128, layers), graphs.broken  # the first bucket: staging, one workspace
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert graphs.prepare_all(layers) > 0 and graphs.broken is None, graphs.broken
    torch.cuda.synchronize()
    added = len(graphs.stats()["buckets"]) - 1
    assert added >= 15
    assert torch.cuda.memory_allocated() - before < added * (1 << 20)
