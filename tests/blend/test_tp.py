"""Tensor-parallel blending (issue 10, CPU part): two gloo ranks, each blending its own KV heads.

Oracle: TP=1 full prefill of the same tiny model. Rank ``r``'s KV must be the KV heads
``[r*H/2, (r+1)*H/2)`` of it and both ranks' logits its logits. The tolerance is a multiple of
the measured gap between two full-prefill attention kernels in float32 (SDPA, and an explicit
``softmax(QK^T)V``): sharding changes nothing but the order of the sums in the row-parallel
projections, a rounding difference of the same kind.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from blend.adapters.hf import HFModelAdapter
from blend.config import BlendConfig
from blend.engine import BlendEngine
from blend.planner import make_plan
from cluster.cache.local import LocalCacheClient
from cluster.workloads.services import free_port
from tests.factories import blend_prompt, random_chunks, tiny_model
from tiers.keys import Namespace, segment_key
from tiers.tier import MemoryTier

pytestmark = pytest.mark.cluster

TP = 2
MODEL = dict(num_layers=4, hidden=64, heads=4, kv_heads=2, vocab=128)
#: Allowed error as a multiple of the two-kernel gap. Measured (2026-11-29, this model and
#: prompt): KV error 0.6-0.7x the KV gap (2.5e-6 vs 3.8e-6), logits error 1.6x (2.6e-6 vs 1.7e-6).
GAP_MULTIPLE = 4


def _namespace(spec, rank: int, size: int) -> str:
    return Namespace(spec.model_id, "tiny", spec.dtype, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                     spec.rope_key, tp_rank=rank, tp_size=size).digest()


def _prompt():
    chunks = random_chunks(3, 24)
    ids, spans = blend_prompt([1, 2, 3], [chunks[1], chunks[2], chunks[0]], [4, 5, 6])
    return chunks, ids, spans


def _blend_all(engine, client, ns, chunks, ids, spans, ratios, selection="k_deviation"):
    """Store each chunk's canonical KV under ``ns``, then blend ``ids`` at each ratio."""
    keys = []
    for c in chunks:
        kv = torch.stack(engine.prefill(c, want_logits=False).kv)  # [L, 2, n, H, D]
        keys.append(segment_key(ns, c))
        client.put(keys[-1], kv)
    out = {"keys": [str(k) for k in keys]}
    for ratio in ratios:
        config = BlendConfig(check_layers=(1,), recompute_ratios=(ratio,), min_tokens=0, selection=selection)
        plan = make_plan(ids, spans, ns, client, config, query_to_engine=True)
        res = engine.blend(plan)
        out[ratio] = {"kv": torch.stack(res.kv), "logits": res.logits, "idx": res.recompute_idx,
                      "hits": res.counters.num_hit_segments, "reason": res.counters.full_prefill_reason}
    return out


class _FailOnRank:
    """A KV source whose layer ``layer_idx`` cannot be read (None per chunk) when ``fail``."""

    def __init__(self, inner, fail: bool, layer_idx: int) -> None:
        self.inner, self.fail, self.layer_idx = inner, fail, layer_idx

    def lookup(self, keys):
        return self.inner.lookup(keys)

    def fetch_layers(self, keys, layer_idxs):
        from blend.protocols import fetch_each

        return fetch_each(self.fetch_layer, keys, layer_idxs)

    def fetch_layer(self, keys, layer_idx):
        if self.fail and layer_idx == self.layer_idx:
            from concurrent.futures import Future

            fut = Future()
            fut.set_result([None] * len(keys))
            return fut
        return self.inner.fetch_layer(keys, layer_idx)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from blend.adapters.hf_tp import HFTensorParallelAdapter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        adapter = HFTensorParallelAdapter(tiny_model(**MODEL), rank, TP, model_id="tiny-llama")
        ns = _namespace(adapter.spec, rank, TP)
        client = LocalCacheClient(MemoryTier(1 << 26, name="host"))
        chunks, ids, spans = _prompt()
        engine = BlendEngine(adapter, client, process_group=dist.group.WORLD)
        out = _blend_all(engine, client, ns, chunks, ids, spans, (1.0, 0.15))
        out["namespace"] = ns
        out["query"] = _blend_all(engine, client, ns, chunks, ids, spans, (0.15,), "query_attention")[0.15]
        # Without the score reduction each rank ranks by its own heads only.
        alone = BlendEngine(adapter, client)
        config = BlendConfig(check_layers=(1,), recompute_ratios=(0.15,), min_tokens=0, selection="k_deviation")
        out["idx_unreduced"] = alone.blend(make_plan(ids, spans, ns, client, config, query_to_engine=True)).recompute_idx
        # A layer that only rank 1 cannot read: both ranks fall back to full prefill together
        # (a lone fallback would leave the ranks' all_reduces mismatched).
        broken = BlendEngine(adapter, _FailOnRank(client, rank == 1, layer_idx=2), process_group=dist.group.WORLD)
        res = broken.blend(make_plan(ids, spans, ns, client, config, query_to_engine=True))
        out["fallback"] = {"reason": res.counters.full_prefill_reason, "logits": res.logits}
        engine.close(), alone.close(), broken.close()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _attention_kernel_gap(adapter, ids) -> tuple[float, float]:
    """Max |KV| and |logits| difference of TP=1 full prefill between SDPA and an explicit
    float32 ``softmax(QK^T / sqrt(D))V`` (the engine's attention swapped)."""
    from blend import engine as engine_module

    def explicit(q, k, v, query_idx, scale, rows=None):
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        n = k.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(n, -1)

    sdpa = BlendEngine(adapter).prefill(ids)
    original = engine_module.causal_attention
    engine_module.causal_attention = explicit
    try:
        other = BlendEngine(adapter).prefill(ids)
    finally:
        engine_module.causal_attention = original
    kv_gap = max(float((a - b).abs().max()) for a, b in zip(sdpa.kv, other.kv, strict=True))
    return kv_gap, float((sdpa.logits - other.logits).abs().max())


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("tp"))
    mp.spawn(_rank_main, args=(free_port(), out_dir), nprocs=TP, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(TP)]


def test_tp2_blend_at_ratio_1_matches_tp1_full_prefill(tp_run):
    adapter = HFModelAdapter(tiny_model(**MODEL), model_id="tiny-llama")
    _, ids, _ = _prompt()
    full = BlendEngine(adapter).prefill(ids)
    kv_gap, logits_gap = _attention_kernel_gap(adapter, ids)
    assert 0 < kv_gap < 1e-4 and 0 < logits_gap < 1e-4, (kv_gap, logits_gap)
    full_kv = torch.stack(full.kv)  # [L, 2, T, H, D]
    heads = adapter.spec.num_kv_heads // TP
    for rank, out in enumerate(tp_run):
        got = out[1.0]
        assert got["reason"] is None and got["hits"] == 3
        want_kv = full_kv[:, :, :, rank * heads:(rank + 1) * heads]
        torch.testing.assert_close(got["kv"], want_kv, rtol=0, atol=GAP_MULTIPLE * kv_gap)
        torch.testing.assert_close(got["logits"], full.logits, rtol=0, atol=GAP_MULTIPLE * logits_gap)
    # the shards hold different heads: rank 0's KV is not rank 1's
    assert not torch.allclose(tp_run[0][1.0]["kv"], tp_run[1][1.0]["kv"], atol=1e-2)


def test_tp2_selection_is_identical_on_every_rank(tp_run):
    a, b = tp_run[0][0.15], tp_run[1][0.15]
    assert a["reason"] is None and b["reason"] is None and a["hits"] == b["hits"] == 3
    assert torch.equal(a["idx"], b["idx"])
    # rows computed above the check layer: 3 prefix + 8 separator + 3 query + ceil(0.15 * 72)
    assert a["idx"].numel() == 3 + 8 + 3 + 11
    # the reduction is what makes them agree: each rank alone ranks by its own heads
    assert not torch.equal(tp_run[0]["idx_unreduced"], tp_run[1]["idx_unreduced"])
    torch.testing.assert_close(a["logits"], b["logits"], rtol=0, atol=0)


def test_tp2_query_attention_selects_the_same_rows_on_every_rank(tp_run):
    """Issue 17 under TP: the query attention mass is summed over the ranks' heads before the
    ranking, so both ranks recompute the same rows (and the same number: the budget)."""
    a, b = tp_run[0]["query"], tp_run[1]["query"]
    assert a["reason"] is None and b["reason"] is None
    assert torch.equal(a["idx"], b["idx"]) and a["idx"].numel() == 3 + 8 + 3 + 11
    torch.testing.assert_close(a["logits"], b["logits"], rtol=0, atol=0)


def test_tp2_ranks_store_and_look_up_under_their_own_namespace(tp_run):
    ns0, ns1 = tp_run[0]["namespace"], tp_run[1]["namespace"]
    assert ns0 != ns1
    keys0, keys1 = set(tp_run[0]["keys"]), set(tp_run[1]["keys"])
    assert not keys0 & keys1
    assert all(k.startswith(ns0 + "/") for k in keys0) and all(k.startswith(ns1 + "/") for k in keys1)


def test_tp2_a_fault_on_one_rank_sends_every_rank_to_full_prefill(tp_run):
    adapter = HFModelAdapter(tiny_model(**MODEL), model_id="tiny-llama")
    _, ids, _ = _prompt()
    full = BlendEngine(adapter).prefill(ids)
    kv_gap, logits_gap = _attention_kernel_gap(adapter, ids)
    reasons = [out["fallback"]["reason"] for out in tp_run]
    assert reasons[0] == "layer 2 could not be read on another tensor-parallel rank"
    assert reasons[1].startswith("layer 2 of chunk")
    for out in tp_run:
        torch.testing.assert_close(out["fallback"]["logits"], full.logits, rtol=0, atol=GAP_MULTIPLE * logits_gap)
