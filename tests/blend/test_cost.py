"""Cost-aware plans (issue 34): with scripted estimates (no clock) a slow tier's chunks are
recomputed and a fast tier's loaded; nothing changes until compute has been measured; a
choice never makes a cached chunk a miss; and whatever is chosen, ratio 1.0 is full prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from blend.cost import apply_choice, blend_seconds, choose
from blend.plan import CHUNK, BlendPlan, Segment
from tests.factories import F32_TOL, blend_prompt, plan_for, random_chunks, store_chunks

pytestmark = pytest.mark.unit

KV_BYTES = 1000  # bytes of one token's KV, every layer


class Scripted:
    """Estimates read from a script: ``seconds_per_row_key`` of compute, ``gbps`` per tier."""

    def __init__(self, gbps: dict[str, float], seconds_per_row: float = 1e-3, known: bool = True,
                 overlap: float = 1.0) -> None:
        self.gbps, self.per_row, self.known, self.overlap = gbps, seconds_per_row, known, overlap

    @property
    def compute_known(self) -> bool:
        return self.known

    def compute_s(self, rows: float, keys: int) -> float:
        return self.per_row * rows

    def prefill_s(self, tokens: int) -> float:
        return self.per_row * tokens

    def transfer_s(self, bytes_by_tier) -> float:
        return sum(n / (self.gbps[t] * 1e9) for t, n in bytes_by_tier.items())


def _plan(tiers: list[str], tokens: int = 100, ratio: float = 0.15) -> BlendPlan:
    """``prefix(10) | chunk per tier (tokens each, hits) | query(10)``, blend_end at the query."""
    segs, pos = [Segment("prefix", 0, 10)], 10
    for t in tiers:
        segs.append(Segment(CHUNK, pos, pos + tokens, hit=True, stored_positions=tuple(range(tokens)), tier=t))
        pos += tokens
    segs.append(Segment("query", pos, pos + 10))
    return BlendPlan(token_ids=tuple(range(pos + 10)), segments=tuple(segs), check_layers=(1,),
                     recompute_ratios=(ratio,), blend_end=pos)


def test_slow_tier_recomputed_fast_tier_loaded():
    # 100 tokens: compute 0.1 s; host moves 100 kB in 10 us, "slow" in 1 s
    plan = _plan(["host", "slow", "host"])
    choice = choose(plan, Scripted({"host": 10.0, "slow": 1e-4}), kv_bytes_per_token=KV_BYTES, num_layers=4)
    assert choice is not None and not choice.full_prefill
    assert choice.recomputed == (2,)  # segments: prefix, host, slow, host, query
    assert [c[3] for c in choice.tiers] == ["load", "recompute", "load"]
    assert choice.blend_s < choice.always_load_s and choice.blend_s < choice.full_s


def test_every_tier_slow_means_full_prefill():
    plan = _plan(["disk", "disk"])
    choice = choose(plan, Scripted({"disk": 1e-5}), kv_bytes_per_token=KV_BYTES, num_layers=4)
    assert choice.full_prefill and len(choice.recomputed) == 2
    assert choice.blend_s == choice.full_s
    out = apply_choice(plan, choice)
    assert out.full_prefill_reason.startswith("cost: full prefill")


def test_fast_tiers_keep_todays_plan():
    plan = _plan(["gpu", "host"])
    choice = choose(plan, Scripted({"gpu": 1e3, "host": 10.0}), kv_bytes_per_token=KV_BYTES, num_layers=4)
    assert choice.recomputed == () and not choice.full_prefill
    assert apply_choice(plan, choice) is plan


def test_nothing_is_chosen_before_compute_is_measured():
    plan = _plan(["slow"])
    assert choose(plan, Scripted({"slow": 1e-6}, known=False), kv_bytes_per_token=KV_BYTES, num_layers=4) is None
    assert apply_choice(plan, None) is plan


def test_explore_loads_the_fastest_chunk_of_a_tier_whatever_its_price():
    plan = _plan(["disk", "disk", "host"])
    est = Scripted({"disk": 1e-5, "host": 10.0})
    assert choose(plan, est, kv_bytes_per_token=KV_BYTES, num_layers=4).recomputed == (1, 2)
    explored = choose(plan, est, kv_bytes_per_token=KV_BYTES, num_layers=4, explore={"disk"})
    assert explored.recomputed == (2,) and not explored.full_prefill


def test_a_recomputed_hit_is_computed_but_never_a_miss_to_store():
    plan = _plan(["host", "slow"])
    choice = choose(plan, Scripted({"host": 10.0, "slow": 1e-4}), kv_bytes_per_token=KV_BYTES, num_layers=4)
    out = apply_choice(plan, choice)
    seg = out.segments[2]
    assert (seg.hit, seg.recomputed, seg.tier, seg.key) == (False, True, "slow", plan.segments[2].key)
    assert out.missed_segments == ()
    assert [s.tier for s in out.hit_segments] == ["host"]


def test_pipeline_price():
    assert blend_seconds(1.0, 0.5, 10) == pytest.approx(1.05)
    assert blend_seconds(0.2, 2.0, 10) == pytest.approx(2.02)
    assert blend_seconds(1.0, 0.5, 10, overlap=0.0) == pytest.approx(1.5)  # one after the other
    assert blend_seconds(1.0, 0.5, 10, overlap=0.5) == pytest.approx(1.275)
    assert blend_seconds(1.0, 0.5, 10, overlap=7.0) == blend_seconds(1.0, 0.5, 10)  # clamped


def test_a_partial_plan_that_only_pays_in_a_perfect_pipeline_is_full_prefill_without_overlap():
    """The H100 placement run's miss: recomputing some chunks while the rest come from disk
    was priced as if reads hid under compute; they ran one after the other."""
    plan = _plan(["disk"] * 4, tokens=250)  # full prefill 1.02 s; every chunk read: 1.0 s
    pipelined = choose(plan, Scripted({"disk": 1e-3}), kv_bytes_per_token=KV_BYTES, num_layers=4)
    assert not pipelined.full_prefill and 0 < len(pipelined.recomputed) < 4  # priced as overlapping
    serial = choose(plan, Scripted({"disk": 1e-3}, overlap=0.0), kv_bytes_per_token=KV_BYTES, num_layers=4)
    assert serial.full_prefill and serial.blend_s == serial.full_s
    assert serial.blend_s <= pipelined.full_s


@pytest.mark.parametrize("recompute", [(), (0,), (1,), (0, 2), (0, 1, 2)])
def test_ratio_one_equals_full_prefill_whatever_is_recomputed(make_setup, recompute):
    """The oracle: a plan whose hits are partly recomputed by the cost choice, blended at ratio
    1.0, gives full prefill's KV and logits; the recomputed chunks are computed, not read."""
    engine, client = make_setup("llama")
    chunks = random_chunks(3, 24)
    store_chunks(engine, client, chunks)
    ids, spans = blend_prompt([1, 2, 3], [chunks[2], chunks[0], chunks[1]], [4, 5, 6, 9])
    plan = plan_for(ids, spans, client, ratio=1.0)
    hits = [i for i, s in enumerate(plan.segments) if s.kind == CHUNK and s.hit]
    chosen = {hits[j] for j in recompute}
    plan = dataclasses.replace(plan, segments=tuple(
        dataclasses.replace(s, hit=False, recomputed=True) if i in chosen else s for i, s in enumerate(plan.segments)))
    res = engine.blend(plan)
    full = engine.prefill(ids)
    assert res.counters.num_hit_segments == 3 - len(recompute)
    assert res.counters.full_prefill_reason is None or len(recompute) == 3
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **F32_TOL)
    assert_close(res.logits, full.logits, **F32_TOL)


def test_a_blend_reports_when_its_last_layer_arrived(make_setup):
    engine, client = make_setup("llama")
    chunks = random_chunks(2, 24)
    store_chunks(engine, client, chunks)
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9])
    res = engine.blend(plan_for(ids, spans, client, ratio=0.15))
    assert res.counters.num_hit_segments == 2
    assert 0 < res.counters.transfer_s < 60
    assert torch.isfinite(res.logits).all()


def test_a_recomputed_chunk_is_never_read(make_setup):
    """The blend asks the source for the loaded chunks' layers only."""
    engine, client = make_setup("llama")
    chunks = random_chunks(3, 24)
    store_chunks(engine, client, chunks)
    asked: list = []
    fetch = client.fetch_layers

    def recording(keys, layers):
        asked.extend(keys)
        return fetch(keys, layers)

    client.fetch_layers = recording
    ids, spans = blend_prompt([1, 2, 3], chunks, [4, 5, 6, 9])
    plan = plan_for(ids, spans, client, ratio=0.15)
    hits = [i for i, s in enumerate(plan.segments) if s.kind == CHUNK and s.hit]
    plan = dataclasses.replace(plan, segments=tuple(
        dataclasses.replace(s, hit=False, recomputed=True) if i == hits[1] else s for i, s in enumerate(plan.segments)))
    res = engine.blend(plan)
    assert res.counters.num_hit_segments == 2
    assert asked and plan.segments[hits[1]].key not in asked
    assert {plan.segments[hits[0]].key, plan.segments[hits[2]].key} <= set(asked)


def test_a_ratio_one_blend_loads_every_hit_whatever_the_prices():
    """At ratio 1.0 every row is recomputed anyway (never sooner than full prefill): it is the
    check of blending against full prefill, so nothing is chosen and every hit loads."""
    slow = Scripted({"host": 1e-5, "disk": 1e-5})  # loading priced far above full prefill
    assert choose(_plan(["host", "disk"], ratio=0.15), slow, kv_bytes_per_token=KV_BYTES, num_layers=4).full_prefill
    assert choose(_plan(["host", "disk"], ratio=1.0), slow, kv_bytes_per_token=KV_BYTES, num_layers=4) is None


def test_the_query_funnels_wider_rows_below_the_check_layer_are_priced():
    """``query_attention`` computes its budget in every layer; with ``query_funnel`` F the layers
    up to the first check layer compute F x the budget: loading every hit costs that much more
    compute (host at 10 GB/s: compute-bound), and F large enough that the set is every row is
    priced as the deviation selections' every-row layers."""
    fast = Scripted({"host": 10.0})
    base = dataclasses.replace(_plan(["host"] * 4, tokens=250, ratio=0.1), selection="query_attention")

    def load_s(plan):
        return choose(plan, fast, kv_bytes_per_token=KV_BYTES, num_layers=4).always_load_s

    fill = 1e6 / 10e9 / 4  # the pipeline's first layer of transfer (1000 tokens at 10 GB/s)
    assert load_s(base) == pytest.approx(1e-3 * (10 + 100) + fill)  # the prefix + 10% of 1000, every layer
    funnel = load_s(dataclasses.replace(base, query_funnel=3.0))  # layers 0-1 at 3x the budget
    assert funnel == pytest.approx(1e-3 * (2 * (10 + 300) + 2 * (10 + 100)) / 4 + fill)
    every = load_s(dataclasses.replace(base, query_funnel=20.0))
    deviation = load_s(dataclasses.replace(base, selection="k_deviation"))
    assert every == pytest.approx(deviation)
