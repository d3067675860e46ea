"""The scheduler half's cost-aware plans (issue 34), without an engine: scripted estimates and a
client whose lookups answer from scripted tiers. A slow tier's chunk is recomputed while a fast
one is loaded, every chunk is still looked up (the shards still promote them), a missed chunk is
still stored and a recomputed one is not, the event log and /metrics counters say what was
chosen, and when nothing is worth loading the request is vLLM's full prefill."""

from __future__ import annotations

import dataclasses

import pytest

from blend.segments import chunk_token_ids
from cluster.vllm.costs import CostEstimator
from cluster.vllm.events import read_events
from tests.cluster.vllm.test_scheduler import (  # noqa: F401 - fixtures
    PASSAGES,
    FakeRequest,
    make_scheduler,
    prompt,
    query_start,
    store_passages,
)
from tests.factories import NAMESPACE
from tiers.keys import segment_key

pytestmark = pytest.mark.unit

KV_BYTES = 10**6  # bytes of one token's KV (scripted: large, so tier speeds decide)


class TieredClient:
    """A client whose lookups report ``tiers[key]`` (default ``host``) as the answering tier,
    and which records every key looked up."""

    def __init__(self, inner, tiers) -> None:
        self.inner, self.tiers, self.looked_up = inner, tiers, []

    def lookup(self, keys):
        self.looked_up += list(keys)
        return [None if m is None else dataclasses.replace(m, tier=self.tiers.get(m.key, "host"))
                for m in self.inner.lookup(keys)]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _estimates(disk_gbps: float) -> CostEstimator:
    """Compute 1 ms per row (whatever the keys); host 1 TB/s; disk as given."""
    est = CostEstimator(k_lin=1.0, priors={"host": (0.0, 1e12), "disk": (0.0, disk_gbps * 1e9)})
    est.k_lin = 0.0
    est.work = lambda rows, keys: float(rows)  # seconds = 1e-3 * rows
    est.add_compute(1000, 1000, 1.0, "blend")
    est.add_compute(1000, 1000, 1.0, "prefill")
    return est


def _key(tokenizer, i: int):
    return segment_key(NAMESPACE, chunk_token_ids(tokenizer, PASSAGES[i]))


def test_a_slow_tiers_chunk_is_recomputed_and_a_fast_ones_loaded(  # noqa: F811 - fixtures
        make_scheduler, client, tokenizer, prompt, events_path):  # noqa: F811
    store_passages(client, tokenizer, which=(0, 1))  # passage 2 is a miss
    slow = _key(tokenizer, 1)
    tiered = TieredClient(client, {slow: "disk"})
    sched = make_scheduler(client=tiered)
    sched.costs, sched._kv_bytes_per_token, sched._num_layers = _estimates(0.001), KV_BYTES, 30
    ids, spans = prompt
    claim, _ = sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0)
    assert claim == query_start(spans)  # still a blend
    plan = sched._requests["r"].plan
    by_key = {s.key: s for s in plan.segments if s.key is not None}
    assert (by_key[slow].hit, by_key[slow].recomputed, by_key[slow].tier) == (False, True, "disk")
    assert by_key[_key(tokenizer, 0)].hit and not by_key[_key(tokenizer, 0)].recomputed
    assert slow in tiered.looked_up  # looked up like any chunk: its shard still promotes it
    lookup = [e for e in read_events(events_path) if e["event"] == "lookup"][0]
    assert sorted(c[2] for c in lookup["cost"]["chunks"]) == ["load", "recompute"]
    assert lookup["cost"]["estimates"]["tiers"]["disk"]["gbps"] == pytest.approx(0.001)
    # stored: the system prompt and passage 2 (misses); never passage 1 (cached, recomputed)
    assert lookup["num_store_segments"] == 2
    assert {k for k, _ in sched._requests["r"].store_segments} | {k for k, *_ in sched._requests["r"].store_prefix} \
        == {s.key for s in plan.missed_segments}
    assert slow not in {s.key for s in plan.missed_segments}
    totals = sched._counters.totals
    assert totals["cost_recomputed_chunks:disk"] == 1 and totals["cost_loaded_chunks:host"] == 1


def test_nothing_worth_loading_means_vllms_full_prefill_and_misses_still_stored(
        make_scheduler, client, tokenizer, prompt, events_path):  # noqa: F811 - fixtures
    store_passages(client, tokenizer, which=(0, 1))
    tiered = TieredClient(client, {_key(tokenizer, 0): "disk", _key(tokenizer, 1): "disk"})
    sched = make_scheduler(client=tiered)
    sched.costs, sched._kv_bytes_per_token, sched._num_layers = _estimates(0.0001), KV_BYTES, 30
    ids, _ = prompt
    assert sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0) == (0, False)
    lookup = [e for e in read_events(events_path) if e["event"] == "lookup"][0]
    assert lookup["path"] == "none" and lookup["full_prefill_reason"].startswith("cost: full prefill")
    assert lookup["cost"]["full_prefill"] is True
    assert lookup["num_store_segments"] == 2  # the system prompt and passage 2, as without the choice


def test_the_setting_off_loads_every_hit(make_scheduler, client, tokenizer, prompt, events_path):  # noqa: F811
    store_passages(client, tokenizer)
    tiered = TieredClient(client, {_key(tokenizer, 1): "disk"})
    sched = make_scheduler(client=tiered, cost_aware=False)
    sched.costs, sched._kv_bytes_per_token, sched._num_layers = _estimates(0.001), KV_BYTES, 30
    ids, spans = prompt
    assert sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0)[0] == query_start(spans)
    assert not any(s.recomputed for s in sched._requests["r"].plan.segments)
    assert read_events(events_path)[0]["cost"] is None
