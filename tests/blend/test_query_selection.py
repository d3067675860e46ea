"""Query-aware selection (``query_attention``, issue 17) against plain-torch references and
full prefill, on tiny random-weight models, float32."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from blend.config import SELECTIONS
from blend.query_selection import (
    chunk_budget_scores,
    chunk_index,
    default_probe_layers,
    fuse_ranks,
    probe_layers_for,
    query_attention_mass,
    select_by_query_mass,
)
from blend.selection import num_to_select
from tests.factories import F32_TOL, blend_prompt, plan_for, random_chunks, store_chunks

pytestmark = pytest.mark.unit


def _setup(make_setup, model_type="llama", num_chunks=3, chunk_len=24, **kw):
    engine, client = make_setup(model_type, **kw)
    chunks = random_chunks(num_chunks, chunk_len)
    store_chunks(engine, client, chunks)
    return engine, client, chunks


def test_mass_matches_full_attention_weights_of_a_tiny_model(make_setup):
    """The ranking signal equals the query rows' attention weights that HF's own eager
    attention computes (summed over heads and query rows) when every row is fresh."""
    engine, _ = make_setup("llama")
    model = engine.model.model
    model.config._attn_implementation = "eager"
    ids = random_chunks(1, 40)[0]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True, use_cache=True)
    layer = 1
    want = out.attentions[layer][0, :, -6:, :].sum(dim=(0, 1))  # [T]: last 6 rows as the query
    # Our side: q and k of that layer from the engine's own adapter over full prefill.
    res = engine.prefill(ids)
    hidden, residual = engine.model.embed(torch.tensor(ids)), None
    positions = torch.arange(len(ids))
    for i in range(layer + 1):
        q, k, v, residual = engine.model.qkv(i, hidden, residual, positions)
        if i < layer:
            from blend.ops import causal_attention
            hidden, residual = engine.model.finish_layer(i, causal_attention(q, k, v, None, engine.scale), residual)
    assert_close(k, res.kv[layer][0], **F32_TOL)
    got = query_attention_mass(q[-6:], positions[-6:], k, engine.scale)
    assert_close(got, want.float(), atol=1e-5, rtol=1e-4)
    assert got.sum().item() == pytest.approx(6 * engine.spec.num_heads, rel=1e-5)


def test_mass_is_causal_and_gqa_aware():
    torch.manual_seed(0)
    q = torch.randn(3, 4, 8)       # Q=3 rows, Hq=4
    k = torch.randn(10, 2, 8)      # T=10, H=2 (groups of 2)
    q_pos = torch.tensor([5, 6, 9])
    got = query_attention_mass(q, q_pos, k, 0.3)
    want = torch.zeros(10)
    for r in range(3):
        for h in range(4):
            logits = (q[r, h] @ k[: q_pos[r] + 1, h // 2].T) * 0.3
            want[: q_pos[r] + 1] += torch.softmax(logits, -1)
    assert_close(got, want)
    with pytest.raises(ValueError):
        query_attention_mass(q, q_pos, torch.randn(10, 3, 8), 0.3)


def test_selection_keeps_sinks_and_the_budget():
    mass = torch.tensor([9.0, 0.1, 0.2, 5.0, 0.3, 0.0, 7.0, 0.05, 0.4, 6.0])
    reused = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    sinks = torch.tensor([1, 5])
    got = select_by_query_mass(mass, reused, sinks, ratio=0.5, num_reused=8)  # budget 4
    assert got.tolist() == [1, 3, 5, 6]  # both sinks, then the two highest (6: 7.0, 3: 5.0)
    # Sinks alone over the budget: the sinks with most mass win, the budget holds.
    got = select_by_query_mass(mass, reused, torch.tensor([1, 2, 4, 8]), ratio=0.25, num_reused=8)
    assert got.tolist() == [4, 8]
    assert select_by_query_mass(mass, reused, sinks, ratio=0.0, num_reused=8).numel() == 0


def _per_chunk(rows, bounds):
    return [sum(a <= r < b for r in rows) for a, b in bounds]


def test_chunk_budget_shares_the_budget_by_each_chunks_query_mass():
    """Three chunks of 10 rows with query mass 6 : 3 : 1 (power 1): a budget of 10 goes 6 / 3 / 1,
    each chunk's share to its own highest-mass rows; a large power gives the most-read chunk
    all it holds first; the budget holds and sinks still come first."""
    torch.manual_seed(0)
    bounds = [(10, 20), (20, 30), (30, 40)]
    mass = torch.zeros(45)
    for (a, b), total in zip(bounds, (6.0, 3.0, 1.0), strict=True):
        w = torch.rand(b - a) + 0.1
        mass[a:b] = w / w.sum() * total
    reused = torch.arange(10, 40)
    idx = chunk_index([type("S", (), {"start": a})() for a, _ in bounds], reused)
    assert idx["chunk_first"].tolist() == [0, 10, 20] and idx["chunk_of"].tolist() == [0] * 10 + [1] * 10 + [2] * 10

    def pick(power, ratio=1 / 3, sinks=None):
        return select_by_query_mass(mass, reused, sinks, ratio=ratio, num_reused=30, chunk_power=power, **idx).tolist()

    got = pick(1.0)
    assert _per_chunk(got, bounds) == [6, 3, 1]
    for (a, b), n in zip(bounds, (6, 3, 1), strict=True):  # each chunk's own top rows
        assert set(r for r in got if a <= r < b) == set((torch.topk(mass[a:b], n).indices + a).tolist())
    assert _per_chunk(pick(8.0), bounds) == [10, 0, 0]
    assert _per_chunk(pick(1e-3), bounds) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])  # even
    assert len(pick(1.0, ratio=0.5)) == 15
    got = pick(8.0, sinks=torch.tensor([20, 30]))
    assert {20, 30} <= set(got) and _per_chunk(got, bounds) == [8, 1, 1]
    assert pick(0.0) == select_by_query_mass(mass, reused, None, ratio=1 / 3, num_reused=30).tolist()
    scores = chunk_budget_scores(mass[reused], idx["chunk_of"], idx["chunk_first"], 1.0)
    assert scores.shape == (30,) and bool(torch.isfinite(scores).all())


def test_chunk_budget_at_the_largest_power_fills_chunks_in_mass_order():
    """Power 64 (the config's ceiling), 12 chunks of 10 rows, one dominant: the budget fills the
    dominant chunk, then the next by mass with its own top rows (no weight underflows to a tie)."""
    torch.manual_seed(1)
    totals = [50.0] + [float(x) for x in range(1, 12)]  # chunk 11 (mass 11) is second
    mass = torch.cat([(torch.rand(10) + 0.1) / 10 * t for t in totals])
    reused = torch.arange(120)
    idx = chunk_index([type("S", (), {"start": 10 * c})() for c in range(12)], reused)
    got = select_by_query_mass(mass, reused, None, ratio=15 / 120, num_reused=120, chunk_power=64.0, **idx).tolist()
    assert got[:10] == list(range(10))
    assert set(got[10:]) == set((torch.topk(mass[110:120], 5).indices + 110).tolist())
    assert bool(torch.isfinite(chunk_budget_scores(mass, idx["chunk_of"], idx["chunk_first"], 64.0)).all())


@pytest.mark.parametrize("power", [0.5, 2.0])
def test_chunk_budget_holds_the_budget_and_ratio_one_is_full_prefill(make_setup, power):
    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])
    res = engine.blend(plan_for(ids, spans, client, ratio=0.15, selection="query_attention", chunk_budget_power=power))
    assert res.counters.selected_tokens == num_to_select(res.counters.reused_tokens, 0.15)
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0, selection="query_attention", chunk_budget_power=power))
    full = engine.prefill(ids)
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, full.logits, **F32_TOL)


@pytest.mark.parametrize("ratio, funnel, check", [(0.15, 2.0, 1), (0.3, 3.0, 2), (0.15, 20.0, 1)])
def test_funnel_keeps_the_budget_from_the_probes_larger_set(make_setup, ratio, funnel, check):
    """``query_funnel``: the probe picks ``funnel`` x the budget (those rows are computed up to
    the check layer), the check layer keeps the budget, sinks first and the rest by K deviation;
    the kept rows are among the probe's; funnel 1 is plain ``query_attention``."""
    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])

    def blend(r, f, **kw):
        res = engine.blend(plan_for(ids, spans, client, ratio=r, selection="query_attention", sink_tokens=2,
                                    query_funnel=f, check_layers=(check,), **kw))
        assert res.counters.selection == "query_attention" and res.counters.full_prefill_reason is None
        return res

    res = blend(ratio, funnel)
    c, num_layers = res.counters, engine.spec.num_layers
    budget, wide = num_to_select(c.reused_tokens, ratio), num_to_select(c.reused_tokens, min(1.0, ratio * funnel))
    assert c.selected_tokens == budget
    assert c.recomputed_tokens_per_layer == ([c.computed_tokens + wide] * (check + 1)
                                             + [c.computed_tokens + budget] * (num_layers - check - 1))
    kept = set(res.recompute_idx.tolist())
    assert kept < set(blend(min(1.0, ratio * funnel), 1.0).recompute_idx.tolist())
    sinks = {s + i for _, s, e in [x for x in spans if x[0] == "chunk"] for i in range(2)}
    assert sinks <= kept
    plain = blend(ratio, 1.0)
    assert set(plain.recompute_idx.tolist()) != kept or funnel * ratio >= 1.0
    assert torch.equal(plain.recompute_idx, blend(ratio, 1.0).recompute_idx)


def test_funnel_with_two_check_layers_and_a_threshold_keeps_its_budget(make_setup):
    """The funnel cuts at the first check layer only, whatever the plan's other check layers, and
    ignores deviation thresholds (its budget holds: they are for the deviation selections)."""
    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])
    res = engine.blend(plan_for(ids, spans, client, ratio=0.15, selection="query_attention", query_funnel=2.0,
                                check_layers=(1, 2), thresholds=(1e3,)))
    c = res.counters
    assert c.full_prefill_reason is None and c.selected_tokens == num_to_select(c.reused_tokens, 0.15)
    wide = num_to_select(c.reused_tokens, 0.3)
    assert c.recomputed_tokens_per_layer[:3] == [c.computed_tokens + wide] * 2 + [c.computed_tokens + c.selected_tokens]
    union = engine.blend(plan_for(ids, spans, client, ratio=0.15, selection="query_k_deviation", check_layers=(1, 2)))
    assert union.counters.full_prefill_reason is None  # one probe ratio per check layer


def test_funnel_at_ratio_one_is_full_prefill(make_setup):
    engine, client, chunks = _setup(make_setup, num_chunks=3, chunk_len=24)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9])
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0, selection="query_attention", query_funnel=2.0))
    full = engine.prefill(ids)
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, full.logits, **F32_TOL)


def test_rank_fusion_adds_reciprocal_ranks_by_hand():
    first = torch.tensor([0.9, 0.1, 0.5, 0.7])   # ranks 0, 3, 2, 1
    second = torch.tensor([1.0, 8.0, 3.0, 2.0])  # ranks 3, 0, 1, 2
    want = torch.tensor([1 / 3 + 1 / 6, 1 / 6 + 1 / 3, 1 / 5 + 1 / 4, 1 / 4 + 1 / 5])  # k = 2, 1-based ranks
    assert_close(fuse_ranks(first, second, 2), want)
    # a row both rankings place second beats one only the first ranks top (small k) ...
    a = torch.arange(10, 0, -1, dtype=torch.float32)  # row i ranks i-th
    b = torch.tensor([0.0, 8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 9.0])  # row 9 first, row 1 second, row 0 last
    fused = fuse_ranks(a, b, 1)
    assert fused.argmax() == 1 and fused[1] > fused[0] and fused[1] > fused[9]
    # ... and ties keep index order like the sorts (equal scores, distinct ranks)
    assert fuse_ranks(torch.zeros(3), torch.zeros(3), 60).argsort(descending=True).tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        fuse_ranks(a, b[:4], 1)
    with pytest.raises(ValueError):
        fuse_ranks(a, b, 0)


@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.15, 0.3])
def test_rank_fusion_keeps_sinks_and_the_budget_and_ranks_by_both(make_setup, monkeypatch, ratio):
    """``query_k_deviation`` with ``rank_fusion``: the probe chooses nothing itself; every row is
    computed up to the check layer, where the reused rows are ranked by the fusion of their K
    deviation and the probe's scores (sinks first), thresholds ignored, the budget held."""
    import blend.query_selection as qs

    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])
    seen = []
    real = qs.fuse_ranks
    monkeypatch.setattr(qs, "fuse_ranks", lambda a, b, k: seen.append((a.clone(), b.clone(), k)) or real(a, b, k))
    res = engine.blend(plan_for(ids, spans, client, ratio=ratio, selection="query_k_deviation", sink_tokens=2,
                                rank_fusion=5, thresholds=(1e9,)))
    c, num_layers = res.counters, engine.spec.num_layers
    budget = num_to_select(c.reused_tokens, ratio)
    assert c.selection == "query_k_deviation" and c.full_prefill_reason is None
    assert c.selected_tokens == budget
    assert c.recomputed_tokens_per_layer == [len(ids)] * 2 + [c.computed_tokens + budget] * (num_layers - 2)
    if budget == 0:
        assert not seen and c.probe_s == 0
        return
    (dev, prior, k), = seen
    assert k == 5 and dev.shape == prior.shape == (c.reused_tokens,) and bool(torch.isfinite(prior).all())
    chunk_rows = [list(range(s, e)) for kind, s, e in spans if kind == "chunk"]
    reused = [r for rows in chunk_rows for r in rows]
    sinks = {rows[i] for rows in chunk_rows for i in range(2)}
    fused = real(dev, prior, 5)
    order = [reused[i] for i in fused.argsort(descending=True, stable=True).tolist() if reused[i] not in sinks]
    want = sinks | set(order[:budget - len(sinks)]) if budget > len(sinks) else None
    kept = set(res.recompute_idx.tolist()) & set(reused)
    if want is not None:
        assert kept == want
    else:
        assert kept <= sinks and len(kept) == budget
    # the probe's ranking is the query's: plain query_attention's top rows (no sinks) lead it
    top = set(engine.blend(plan_for(ids, spans, client, ratio=0.05, selection="query_attention",
                                    sink_tokens=0)).recompute_idx.tolist()) & set(reused)
    lead = {reused[i] for i in prior.argsort(descending=True)[:len(top)].tolist()}
    assert top == lead


def test_rank_fusion_at_ratio_one_is_full_prefill_and_changes_the_split(make_setup):
    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0, selection="query_k_deviation", rank_fusion=60))
    full = engine.prefill(ids)
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, full.logits, **F32_TOL)

    def rows(**kw):
        return set(engine.blend(plan_for(ids, spans, client, ratio=0.3, selection="query_k_deviation",
                                         sink_tokens=2, **kw)).recompute_idx.tolist())

    assert rows(rank_fusion=1) != rows()  # not the half-and-half split (rank_fusion=0: the test above)


def test_rank_fusion_ignores_thresholds_when_its_probe_is_skipped_and_sinks_lead_in_fused_order(make_setup,
                                                                                                 monkeypatch):
    """A budget of every reused row skips the probe: thresholds still do not cut it. A budget
    below the sinks keeps the sinks the fusion ranks highest (not an arbitrary subset)."""
    import blend.query_selection as qs

    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0, selection="query_k_deviation", rank_fusion=60,
                                thresholds=(1e9,)))
    assert res.counters.selected_tokens == res.counters.reused_tokens == 120
    seen = []
    real = qs.fuse_ranks
    monkeypatch.setattr(qs, "fuse_ranks", lambda a, b, k: seen.append(real(a, b, k)) or seen[-1])
    res = engine.blend(plan_for(ids, spans, client, ratio=0.05, selection="query_k_deviation", sink_tokens=4,
                                rank_fusion=60))
    budget = num_to_select(120, 0.05)  # 6 of 16 sinks
    chunk_rows = [list(range(s, e)) for kind, s, e in spans if kind == "chunk"]
    reused = [r for rows in chunk_rows for r in rows]
    sinks = [i for i, r in enumerate(reused) if any(r in rows[:4] for rows in chunk_rows)]
    fused, = seen
    want = {reused[i] for i in sorted(sinks, key=lambda i: -float(fused[i]))[:budget]}
    assert set(res.recompute_idx.tolist()) & set(reused) == want


def test_default_probe_layers_follow_depth():
    assert default_probe_layers(30) == (8, 11, 15)
    assert default_probe_layers(4) == (1, 2)
    assert probe_layers_for((5, 2, 5), 30) == (2, 5)
    with pytest.raises(ValueError):
        probe_layers_for((30,), 30)


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_ratio_one_is_full_prefill_in_every_mode(make_setup, model_type, selection):
    engine, client, chunks = _setup(make_setup, model_type)
    ids, spans = blend_prompt([1, 2, 3], [chunks[2], chunks[0], chunks[1]], [4, 5, 6, 9])
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0, selection=selection))
    full = engine.prefill(ids)
    assert res.counters.full_prefill_reason is None and res.counters.selection == selection
    assert res.counters.selected_tokens == 72
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, full.logits, **F32_TOL)


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("ratio", [0.0, 0.05, 0.15, 0.3])
def test_budget_holds_in_every_mode(make_setup, selection, ratio):
    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])
    res = engine.blend(plan_for(ids, spans, client, ratio=ratio, selection=selection, sink_tokens=4))
    c = res.counters
    budget = num_to_select(c.reused_tokens, ratio)
    assert c.selected_tokens == budget
    assert res.recompute_idx.numel() == c.computed_tokens + budget
    if selection == "query_attention":  # every layer computes the same rows, layer 0 included
        assert c.recomputed_tokens_per_layer == [c.computed_tokens + budget] * engine.spec.num_layers
        assert (c.probe_s > 0) == (budget > 0)
    if selection == "query_k_deviation":  # every row up to the check layer (1), the budget above
        num_layers = engine.spec.num_layers
        assert c.recomputed_tokens_per_layer == [len(ids)] * 2 + [c.computed_tokens + budget] * (num_layers - 2)
        assert (c.probe_s > 0) == (num_to_select(c.reused_tokens, ratio / 2) > 0)


@pytest.mark.parametrize("ratio", [0.15, 0.3])
def test_query_k_deviation_is_the_probe_half_and_the_top_k_deviation(make_setup, ratio):
    """``query_k_deviation`` at ratio r recomputes every row ``query_attention`` picks at r/2
    (same probe, same sinks) and fills the rest of r's budget with the highest K deviations:
    those are among the rows ``k_deviation`` picks at r (the top of the rest is inside the
    top of all)."""
    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9, 10])

    def rows(selection, r):
        res = engine.blend(plan_for(ids, spans, client, ratio=r, selection=selection, sink_tokens=2))
        assert res.counters.selection == selection and res.counters.full_prefill_reason is None
        return set(res.recompute_idx.tolist()), res

    union, res = rows("query_k_deviation", ratio)
    probe, _ = rows("query_attention", ratio / 2)
    by_k, _ = rows("k_deviation", ratio)
    assert probe < union
    assert union - probe <= by_k
    assert len(union) == len(by_k) == res.counters.computed_tokens + num_to_select(res.counters.reused_tokens, ratio)
    assert union != by_k and union != probe | by_k  # a real mix, not either mode alone


PASSAGES = [
    "The Amazon river flows through Brazil, Peru and Colombia and carries more water than any "
    "other river on Earth. Its basin covers about seven million square kilometres of rainforest.",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa. Its summit, Uhuru Peak, "
    "rises 5,895 metres above sea level and is covered by shrinking glaciers.",
    "The painter Ilse Marvenholt was born in the harbour town of Quellstad in 1871. She spent "
    "her whole life in Quellstad and painted its fishing boats in more than four hundred works.",
    "The Great Barrier Reef lies off the coast of Queensland in Australia. It is the largest "
    "coral reef system in the world and can be seen from space.",
]


def test_query_attention_recomputes_the_passage_the_answer_is_in(smollm2_path):
    """SmolLM2-135M, four passages, a question only passage 2 answers: at ratio 0.15 with no
    sink tokens, passage 2 gets the largest share of the recompute set under
    ``query_attention`` (more than a quarter, its fair share)."""
    from transformers import AutoTokenizer

    from blend.adapters.hf import HFModelAdapter
    from blend.engine import BlendEngine
    from blend.segments import build_blend_prompt, chunk_token_ids
    from cluster.cache.local import LocalCacheClient
    from tests.factories import NAMESPACE
    from tiers.keys import segment_key
    from tiers.tier import MemoryTier

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    adapter = HFModelAdapter.from_pretrained(smollm2_path, dtype=torch.float32)
    client = LocalCacheClient(MemoryTier(1 << 30, name="host"))
    engine = BlendEngine(adapter, client)
    for text in PASSAGES:
        ids = chunk_token_ids(tokenizer, text)
        client.put(segment_key(NAMESPACE, ids), torch.stack(engine.prefill(ids, want_logits=False).kv))
    client.flush()
    ids, spans = build_blend_prompt(tokenizer, "Answer from the passages.", PASSAGES,
                                    "Question: In which town was the painter Ilse Marvenholt born?\nAnswer:",
                                    add_bos=False)
    with torch.no_grad():
        res = engine.blend(plan_for(ids, spans, client, ratio=0.15, selection="query_attention", sink_tokens=0))
    assert res.counters.selection == "query_attention" and res.counters.num_hit_segments == 4
    chunk_spans = [(s, e) for kind, s, e in spans if kind == "chunk"]
    chosen = res.recompute_idx.tolist()
    share = [sum(s <= r < e for r in chosen) for s, e in chunk_spans]
    assert sum(share) == res.counters.selected_tokens
    assert max(range(4), key=share.__getitem__) == 2, share
    assert share[2] > sum(share) / 4, share


def test_query_attention_without_a_query_falls_back_to_k_deviation(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [])  # ends with a separator: no query segment
    res = engine.blend(plan_for(ids, spans, client, ratio=0.15, selection="query_attention"))
    assert res.counters.selection == "k_deviation"
    assert res.counters.selection_fallback == "no query segment"
    assert res.counters.selected_tokens == num_to_select(72, 0.15)


def test_query_attention_with_the_query_left_to_vllm(make_setup):
    """blend_end < T (the connector): the probe reads the query rows, the blend returns only
    ``[0, blend_end)``; at ratio 1.0 that equals full prefill of the prompt's first rows."""
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9])
    for ratio in (0.15, 1.0):
        plan = plan_for(ids, spans, client, ratio=ratio, selection="query_attention", query_to_engine=False)
        assert plan.blend_end < len(ids)
        res = engine.blend(plan, want_logits=False)
        assert res.counters.selection == "query_attention" and res.counters.full_prefill_reason is None
        assert all(kv.shape[1] == plan.blend_end and kv.is_contiguous() for kv in res.kv)
    full = engine.prefill(ids[:plan.blend_end], want_logits=False)
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)


def test_query_attention_unreadable_layer_falls_back_to_full_prefill(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    plan = plan_for(ids, spans, client, ratio=0.15, selection="query_attention")
    client.fetch_layers = lambda keys, layers: [_resolved(None) for _ in layers]
    res = engine.blend(plan)
    full = engine.prefill(ids)
    assert res.counters.full_prefill_reason is not None
    assert_close(res.logits, full.logits, **F32_TOL)


def _resolved(value):
    from concurrent.futures import Future

    fut = Future()
    fut.set_result(value)
    return fut


def test_the_probe_is_sliced_into_steps_and_waits_are_not_probe_time(make_setup):
    """blend_steps yields once per probe layer before the blend's layers (vLLM's async path
    interleaves other requests between steps); probe_s counts compute only."""
    from blend.engine import run_steps

    engine, client, chunks = _setup(make_setup, num_chunks=4, chunk_len=30)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9])
    plan = plan_for(ids, spans, client, ratio=0.15, selection="query_attention", probe_layers=(1, 2))
    steps = list(_steps(engine.blend_steps(plan)))
    num_layers = engine.spec.num_layers
    assert steps == [0, 1, 2] + list(range(num_layers))
    res = run_steps(engine.blend_steps(plan))
    assert 0 < res.counters.probe_s <= res.counters.compute_s


def _steps(gen):
    with torch.no_grad():
        while True:
            try:
                yield next(gen)
            except StopIteration:
                return


def test_probe_layers_outside_the_model_are_refused_at_any_ratio(make_setup):
    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    for ratio in (0.0, 0.15, 1.0):
        with pytest.raises(ValueError, match="probe_layers"):
            engine.blend(plan_for(ids, spans, client, ratio=ratio, selection="query_attention",
                                  probe_layers=(engine.spec.num_layers,)))


def test_counters_name_the_selection_that_chose_the_rows(make_setup):
    import dataclasses

    engine, client, chunks = _setup(make_setup)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6])
    cold = plan_for(ids, spans, LocalCacheClientEmpty(), ratio=0.15, selection="query_attention")
    assert engine.blend(cold).counters.selection == ""  # no hits: nothing was selected
    plan = plan_for(ids, spans, client, ratio=0.15, selection="query_attention")
    forced = dataclasses.replace(plan, forced_recompute=(10, 11))
    assert engine.blend(forced).counters.selection == "forced"
    assert engine.blend(plan).counters.selection == "query_attention"
    assert engine.blend(dataclasses.replace(plan, selection="v_deviation")).counters.selection == "v_deviation"


def LocalCacheClientEmpty():  # noqa: N802 - a factory named like the class it builds
    from cluster.cache.local import LocalCacheClient
    from tiers.tier import MemoryTier

    return LocalCacheClient(MemoryTier(1 << 20, name="host"))


def test_the_probe_leaves_missed_chunks_out(make_setup, monkeypatch):
    """A missed chunk has no cached KV and is computed by the blend anyway: the probe neither
    computes nor attends to its rows (every probe layer's keys are the prompt without them),
    its rows get no mass, and the blend still spends the whole budget on reused rows."""
    import blend.query_selection as qs

    engine, client, chunks = _setup(make_setup, num_chunks=3, chunk_len=30)
    missed = random_chunks(1, 30, seed=7)[0]  # never stored
    ids, spans = blend_prompt([1, 2, 3], [chunks[0], missed, chunks[1], chunks[2]], [4, 5, 6, 9, 10])
    keys_seen, real = [], qs.query_attention_mass

    def spy(q, q_pos, k, scale, v=None):
        keys_seen.append(k.shape[0])
        return real(q, q_pos, k, scale, v)

    monkeypatch.setattr(qs, "query_attention_mass", spy)
    res = engine.blend(plan_for(ids, spans, client, ratio=0.15, selection="query_attention", sink_tokens=4))
    c = res.counters
    assert keys_seen and set(keys_seen) == {len(ids) - len(missed)}
    assert c.selected_tokens == num_to_select(c.reused_tokens, 0.15) > 0
    (start, end), = [(s, e) for kind, s, e in spans if kind == "chunk"][1:2]
    assert set(range(start, end)) <= set(res.recompute_idx.tolist())  # the blend computes the miss
