"""CPU: blend.ops reference paths, the FlexAttention block mask, the engine over a staged host
tier. The staging source alone: ``tests/tiers/test_staging.py``; ``kvblend bench gpu``:
``tests/cluster/bench/test_gpu_bench.py``."""

from __future__ import annotations

import warnings

import pytest
import torch

from blend import engine as engine_module
from blend import flex_rows, ops
from blend.attention import blocked_row_attention, dense_attention_reference
from blend.engine import BlendEngine
from blend.rope import rerotate_k
from blend.selection import num_to_select, squared_deviation, top_n_indices
from tests.factories import F32_TOL, all_hit_plan, fill_tiers, ops_adapter, random_chunks
from tiers.host import HostTier
from tiers.staging import StagedSource

pytestmark = pytest.mark.unit


def test_select_top_ratio_with_candidates_threshold_and_ratio():
    scores = torch.tensor([0.5, 3.0, 0.1, 2.0, 9.0, 0.0])
    rows = torch.tensor([10, 11, 12, 13, 14, 15])
    assert ops.select_top_ratio(scores, 0.5, None, rows).tolist() == [11, 13, 14]
    assert ops.select_top_ratio(scores, 0.5, 2.5, rows).tolist() == [11, 14]
    assert ops.select_top_ratio(scores, 0.5).tolist() == top_n_indices(scores, num_to_select(6, 0.5)).tolist()
    assert ops.select_top_ratio(scores, 0.15, None, rows, num_reused=20).tolist() == [11, 13, 14]
    assert ops.select_top_ratio(scores, 0.0, None, rows).numel() == 0
    with pytest.raises(ValueError):
        ops.select_top_ratio(scores, 1.5)
    with pytest.raises(ValueError):
        ops.select_top_ratio(scores, 0.5, None, rows[:3])


def test_cpu_dispatch_equals_references():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(20, 2, 16, generator=g)
    frm, to = torch.arange(20), torch.arange(20) + 40
    inv = (1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)).float()
    want = rerotate_k(k, frm, to, inv)
    assert torch.equal(ops.rerotate_k_(k, frm, to, inv), want) and torch.equal(k, want)
    fresh, cached = torch.randn(7, 2, 16, generator=g), torch.randn(20, 2, 16, generator=g)
    idx = torch.tensor([3, 1, 19, 0, 5, 6, 2])
    assert torch.equal(ops.deviation_scores(fresh, cached, None, idx), squared_deviation(fresh, cached[idx]))


@pytest.mark.parametrize("layout,shape", [("flash_attn", (2, 5, 4, 2, 8)), ("flashinfer", (5, 2, 4, 2, 8))])
def test_paged_ops_match_cluster_paged(layout, shape):
    from cluster.vllm.paged import gather_kv, scatter_kv

    g = torch.Generator().manual_seed(2)
    cache = torch.randn(shape, generator=g)
    slots = torch.tensor([19, 0, 7, 8, 3])
    assert torch.equal(ops.gather_paged(cache, layout, slots), gather_kv(cache, layout, slots))
    kv = torch.randn(2, 5, 2, 8, generator=g)
    a, b = cache.clone(), cache.clone()
    ops.scatter_paged(a, layout, kv, slots)
    scatter_kv(b, layout, kv, slots)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        ops.gather_paged(cache, layout, torch.tensor([20]))


@pytest.mark.parametrize("num_keys,num_q,block", [(300, 40, 16), (130, 130, 128), (257, 9, 32)])
@pytest.mark.parametrize("ordered", [True, False])
def test_block_mask_gives_per_row_causal_attention(num_keys, num_q, block, ordered):
    """Eager FlexAttention with :func:`ops.build_block_mask` equals the dense float64 reference."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(num_keys + num_q)
    q = torch.randn(num_q, 4, 16, generator=g)
    k, v = torch.randn(num_keys, 2, 16, generator=g), torch.randn(num_keys, 2, 16, generator=g)
    pos = torch.randperm(num_keys, generator=g)[:num_q]
    if ordered:
        pos = pos.sort().values
    mask = ops.build_block_mask(pos, torch.arange(num_keys) if ordered else None, num_keys, block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out = flex_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                             block_mask=mask, scale=0.25, enable_gqa=True)
    got = out[0].transpose(0, 1).reshape(num_q, -1)
    torch.testing.assert_close(got, dense_attention_reference(q, k, v, pos, 0.25), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.selected_row_attention(q, pos, k, v, None, 0.25),
                               dense_attention_reference(q, k, v, pos, 0.25), rtol=1e-5, atol=1e-5)


def test_causal_attention_is_a_drop_in_for_blocked_row_attention(monkeypatch):
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(50, 4, 16, generator=g), torch.randn(50, 2, 16, generator=g), torch.randn(50, 2, 16, generator=g)
    torch.testing.assert_close(ops.causal_attention(q, k, v, None, 0.25), blocked_row_attention(q, k, v, None, 0.25))
    idx = torch.tensor([0, 7, 8, 30, 49])
    monkeypatch.setattr(flex_rows, "REFERENCE_QUERY_BLOCK", 2)  # several query blocks
    torch.testing.assert_close(ops.causal_attention(q[idx], k, v, idx, 0.25), blocked_row_attention(q[idx], k, v, idx, 0.25))
    with pytest.raises(ValueError):
        ops.causal_attention(q[:3], k, v, idx, 0.25)










@pytest.mark.parametrize("ratio", [1.0, 0.3])
def test_engine_with_ops_over_staged_host_tier(monkeypatch, ratio):
    """The proposed integration on CPU: ops.causal_attention in the engine, ops re-rotation, KV staged
    from a host tier. Ratio 1.0 reproduces full prefill; 0.3 matches the engine as it is."""
    adapter = ops_adapter()
    chunks = random_chunks(3, 24, low=4)
    host = HostTier(1 << 26)
    fill_tiers(BlendEngine(adapter), chunks, [host])
    plan = all_hit_plan(chunks, ratio)
    src = StagedSource(host, "cpu")
    src.lookup([s.key for s in plan.hit_segments])
    as_is = BlendEngine(adapter, src).blend(plan)
    monkeypatch.setattr(engine_module, "causal_attention", ops.causal_attention)
    got = BlendEngine(adapter, src).blend(plan)
    assert got.counters.full_prefill_reason is None and got.counters.num_hit_segments == 3
    torch.testing.assert_close(got.logits, as_is.logits, **F32_TOL)
    if ratio == 1.0:
        full = BlendEngine(adapter).prefill(list(plan.token_ids))
        torch.testing.assert_close(got.logits, full.logits, **F32_TOL)
        for a, b in zip(got.kv, full.kv, strict=False):
            torch.testing.assert_close(a, b, **F32_TOL)
    src.close()








@pytest.mark.parametrize("num_q", [1, 77, 128, 300])
def test_flex_path_pads_queries_and_matches_reference(monkeypatch, num_q):
    """The CUDA path (query padding to 128 rows, cached key blocks), run with eager flex."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_rows, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(num_q)
    q = torch.randn(num_q, 4, 16, generator=g)
    k, v = torch.randn(400, 2, 16, generator=g), torch.randn(400, 2, 16, generator=g)
    pos = torch.randperm(400, generator=g)[:num_q].sort().values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_rows._flex_rows(q, pos, k, v, None, 0.25)
        got_kv = flex_rows._flex_rows(q, pos, k, v, torch.arange(400), 0.25)
    want = dense_attention_reference(q, k, v, pos, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv, want, rtol=1e-5, atol=1e-5)


def test_angle_table_cache_misses_on_in_place_edit():
    from blend.kernels.rope import angle_table

    frm, to = torch.arange(6), torch.arange(6) + 3
    inv = torch.tensor([1.0, 0.5])
    cos1, _ = angle_table(frm, to, inv, torch.device("cpu"))
    assert angle_table(frm, to, inv, torch.device("cpu"))[0] is cos1  # reused
    to += 1  # same tensor, new contents
    cos2, _ = angle_table(frm, to, inv, torch.device("cpu"))
    assert cos2 is not cos1 and torch.allclose(cos2[:, 0], torch.cos(torch.full((6,), 4.0, dtype=torch.float64)).float())


def test_prepared_rows_are_reused_and_checked(monkeypatch):
    """A RowMask built once per request gives the same attention as per-call masks."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_rows, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(21)
    pos = torch.randperm(500, generator=g)[:150].sort().values
    rows = ops.prepare_rows(pos, 500)
    assert rows.num_q == 150 and rows.q_pos_padded.numel() == 256
    want_all = []
    for _layer in range(2):  # two layers, same rows, new q/k/v
        q = torch.randn(150, 4, 16, generator=g)
        k, v = torch.randn(500, 2, 16, generator=g), torch.randn(500, 2, 16, generator=g)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = flex_rows._flex_rows(q, pos, k, v, None, 0.25, rows)
        want = dense_attention_reference(q, k, v, pos, 0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ops.causal_attention(q, k, v, pos, 0.25, rows), want, rtol=1e-5, atol=1e-5)
        want_all.append(want)
    with pytest.raises(ValueError, match="prepared"):
        ops.selected_row_attention(q[:10], pos[:10], k, v, None, 0.25, rows=rows)
    with pytest.raises(TypeError):
        ops.prepare_rows(pos.float(), 500)




def test_shape_buckets_bound_the_compiled_shapes():
    """FlexAttention compiles once per (rows, keys) shape: buckets waste at most half and
    give about two shapes per doubling, so 1..128K tokens fit in a few dozen shapes."""
    buckets = {ops.shape_bucket(n) for n in range(1, 131073)}
    assert len(buckets) <= 2 * 11
    for n in (1, 127, 128, 129, 193, 1000, 6000, 8257, 65537):
        b = ops.shape_bucket(n)
        assert n <= b and b % ops.FLEX_BLOCK == 0 and b <= max(1.5 * n, n + ops.FLEX_BLOCK)


@pytest.mark.parametrize("num_q,num_kv", [(1, 130), (129, 1000), (300, 700), (700, 700)])
def test_bucketed_rows_and_keys_attend_like_the_reference(monkeypatch, num_q, num_kv):
    """Padded query rows and padded keys (to their shape buckets) change nothing: with and
    without a prepared RowMask, with and without explicit key positions."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex_rows, "_compiled_flex", lambda: flex_attention)
    g = torch.Generator().manual_seed(num_q + num_kv)
    q = torch.randn(num_q, 4, 16, generator=g)
    k, v = torch.randn(num_kv, 2, 16, generator=g), torch.randn(num_kv, 2, 16, generator=g)
    pos = torch.randperm(num_kv, generator=g)[:num_q].sort().values
    rows = ops.prepare_rows(pos, num_kv)
    assert rows.kv_len == ops.shape_bucket(num_kv) and rows.q_pos_padded.numel() == ops.shape_bucket(num_q)
    want = dense_attention_reference(q, k, v, pos, 0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for got in (flex_rows._flex_rows(q, pos, k, v, None, 0.25), flex_rows._flex_rows(q, pos, k, v, None, 0.25, rows),
                    flex_rows._flex_rows(q, pos, k, v, torch.arange(num_kv), 0.25)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiling_flex_raises_dynamo_recompile_limit(monkeypatch):
    """Past dynamo's default of 8 shapes flex_attention would run unfused: the compiled
    wrapper lifts the limit to FLEX_RECOMPILE_LIMIT (never lowers a larger one)."""
    import torch._dynamo

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(torch._dynamo.config, name, 8)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    flex_rows._compiled_flex.cache_clear()
    try:
        flex_rows._compiled_flex()
        assert getattr(torch._dynamo.config, name) == flex_rows.FLEX_RECOMPILE_LIMIT
    finally:
        flex_rows._compiled_flex.cache_clear()
