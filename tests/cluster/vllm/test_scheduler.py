"""The connector's scheduler half without an engine: a fake ``Request``, ``KVCacheBlocks`` and
``SchedulerOutput``, a :class:`~cluster.cache.local.LocalCacheClient` holding some chunks, the
real SmolLM2 tokenizer (segments are found on its token bytes). Each test checks one decision:
what is claimed (and whether asynchronously), what the worker is told to load and store, and
when vLLM must hold a request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from blend.segments import build_blend_prompt, chunk_token_ids
from cluster.cache.local import LocalCacheClient
from cluster.config import load_config
from cluster.vllm.events import EventLog, read_events
from cluster.vllm.metrics import Counters
from cluster.vllm.scheduler import KVBlendScheduler
from cluster.vllm.tp_lookup import AllRanksLookup
from tests.factories import NAMESPACE, make_kv, make_namespace
from tiers.keys import prefix_keys, segment_key

pytestmark = pytest.mark.unit

BLOCK_SIZE = 16
CHUNK_SIZE = 32
SYSTEM = "Answer from the passages."
PASSAGES = [
    "The river council of Arden met every spring near the old harbor to settle the rights of the "
    "fishermen, and its records fill eleven volumes kept in the town library.",
    "Lighthouse keepers on Varo island logged each ship that passed the strait; the logbooks name "
    "four hundred vessels between 1810 and 1850, most of them merchant brigs.",
    "The cathedral of Mena was rebuilt twice after fires, in 1702 and in 1788, each time by the "
    "same guild of masons whose marks are still visible on the western portal.",
]
OTHER_PASSAGE = ("Canal boats on the northern route carried grain and timber until the railway "
                 "reached the valley in 1861; the last lock keeper retired in 1904.")


@dataclass
class FakeRequest:
    """What the scheduler half reads of vLLM's ``Request``."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None   # vLLM copies SamplingParams.extra_args' here


class FakeBlocks:
    """vLLM's ``KVCacheBlocks``: ``get_block_ids()`` is one list per KV cache group."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = list(block_ids)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.block_ids,)


def step(new=(), cached=()):
    """A ``SchedulerOutput``: ``new`` = ``(request id, block ids, computed, scheduled)``,
    ``cached`` = ``(request id, new block ids or None, computed, scheduled, resumed)``."""
    num_scheduled = {rid: n for rid, _, _, n in new} | {c[0]: c[3] for c in cached}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(list(blocks),), num_computed_tokens=done)
                            for rid, blocks, done, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None if c[1] is None else (list(c[1]),) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids={c[0] for c in cached if c[4]}),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()))


def slots(block_ids: list[int], start: int, end: int) -> list[int]:
    """vLLM's flat slot of each token in ``[start, end)``, computed by hand."""
    return [block_ids[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(start, end)]


def store(client, key, num_tokens: int) -> None:
    client.put(key, make_kv(num_layers=1, num_tokens=num_tokens, num_kv_heads=1, head_dim=2),
               positions=list(range(num_tokens)))


@pytest.fixture
def make_scheduler(tokenizer, client, events_path):
    """``make_scheduler(**overrides)``: a scheduler half over ``client`` (config overrides
    as in ``kv_connector_extra_config``; ``tp_size``/``load_async``/``client`` as keywords)."""

    def make(tp_size: int = 1, load_async: bool = True, client=client, allow_request_overrides: bool = True,
             **overrides) -> KVBlendScheduler:
        config = load_config(environ={}, overrides={"min_tokens": 16, "chunk_size": CHUNK_SIZE,
                                                    **overrides})
        return KVBlendScheduler(config, client, namespace_digest=NAMESPACE, block_size=BLOCK_SIZE,
                                load_tokenizer=lambda: tokenizer, tp_size=tp_size, load_async=load_async,
                                allow_request_overrides=allow_request_overrides,
                                events=EventLog(events_path), counters=Counters())

    return make


@pytest.fixture
def prompt(tokenizer):
    """``(token ids, spans)`` of the system prompt, the three passages and a question."""
    return build_blend_prompt(tokenizer, SYSTEM, PASSAGES, "Question: which island?")


def store_passages(client, tokenizer, which=(0, 1, 2)) -> None:
    for i in which:
        ids = chunk_token_ids(tokenizer, PASSAGES[i])
        store(client, segment_key(NAMESPACE, ids), len(ids))


def query_start(spans) -> int:
    return [s for kind, s, _ in spans if kind == "query"][0]


def test_all_chunks_cached_claims_up_to_the_query_on_the_async_path(make_scheduler, client, tokenizer,
                                                                     prompt, events_path):
    store_passages(client, tokenizer)
    ids, spans = prompt
    sched = make_scheduler()
    assert sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0) == (query_start(spans), True)
    lookup, claim = read_events(events_path)
    assert (lookup["event"], lookup["path"], lookup["num_hit_segments"]) == ("lookup", "blend", 3)
    # the one segment to store is the system prompt: a first segment is a chunk too (issue 21)
    assert lookup["num_store_segments"] == 1 and lookup["tier_hits"] == {"host": 3}
    assert (claim["event"], claim["claimed_tokens"], claim["load_async"]) == ("claim", query_start(spans), True)


def test_local_prefix_hit_is_subtracted_and_asking_again_looks_up_nothing(make_scheduler, client,
                                                                          tokenizer, prompt):
    store_passages(client, tokenizer)
    ids, spans = prompt
    sched = make_scheduler()
    req = FakeRequest("r", ids)
    assert sched.get_num_new_matched_tokens(req, 0)[0] == query_start(spans)
    lookups = client.counters["lookups"]
    assert sched.get_num_new_matched_tokens(req, 32) == (query_start(spans) - 32, True)
    assert client.counters["lookups"] == lookups          # the plan is reused
    assert sched._counters.totals["requests"] == 1
    # vLLM already holds everything the connector would produce: nothing to claim
    assert sched.get_num_new_matched_tokens(req, query_start(spans)) == (0, False)


def test_a_missed_chunk_is_computed_by_vllm_and_scheduled_for_storing_once(make_scheduler, client,
                                                                          tokenizer, prompt, events_path):
    store_passages(client, tokenizer, which=(0, 2))
    ids, spans = prompt
    sched = make_scheduler()
    # two hits (> min_tokens): still a blend; the miss is stored
    claim, is_async = sched.get_num_new_matched_tokens(FakeRequest("a", ids), 0)
    assert (claim, is_async) == (query_start(spans), True)
    missed = segment_key(NAMESPACE, chunk_token_ids(tokenizer, PASSAGES[1]))
    sched.update_state_after_alloc(FakeRequest("a", ids), FakeBlocks(range(40)), claim)
    meta = sched.build_connector_meta(step())
    assert [s.request_id for s in meta.loads] == ["a"]
    meta = sched.build_connector_meta(step(cached=[("a", None, claim, len(ids) - claim, False)]))
    (spec,) = meta.stores
    # the system prompt (first segment, a chunk too: issue 21) is computed canonically as well
    system = segment_key(NAMESPACE, ids[:spans[0][2]])
    assert [k for k, _ in spec.segments] == [system, missed]
    assert list(spec.segments[1][1]) == chunk_token_ids(tokenizer, PASSAGES[1])
    # another request missing the same chunk does not store it again
    ids2, _ = build_blend_prompt(tokenizer, SYSTEM, PASSAGES[::-1], "Question: when?")
    sched.get_num_new_matched_tokens(FakeRequest("b", ids2), 0)
    assert read_events(events_path)[-2]["num_store_segments"] == 0


def test_nothing_cached_claims_nothing(make_scheduler, prompt, events_path):
    ids, _ = prompt
    assert make_scheduler().get_num_new_matched_tokens(FakeRequest("r", ids), 0) == (0, False)
    lookup = read_events(events_path)[0]
    assert lookup["path"] == "none" and lookup["num_store_segments"] == 4   # 3 passages + the system prompt
    assert lookup["full_prefill_reason"].startswith("fewer than min_tokens")


@pytest.mark.parametrize("params, reason", [
    ({"kvblend_load": False}, None),                       # planned (and stored), not loaded
    ({"kvblend_blend": False}, "blending disabled"),
])
def test_request_params_turn_loading_off(make_scheduler, client, tokenizer, prompt, events_path, params,
                                         reason):
    store_passages(client, tokenizer)
    ids, _ = prompt
    assert make_scheduler().get_num_new_matched_tokens(FakeRequest("r", ids, params), 0) == (0, False)
    lookup = read_events(events_path)[0]
    assert lookup["path"] == "none" and lookup["full_prefill_reason"] == reason


def test_a_request_that_neither_loads_nor_stores_looks_nothing_up(make_scheduler, client, tokenizer, prompt,
                                                                   events_path):
    """A lookup starts the shards' promotions into host memory: a request that will neither
    read nor write the cache (``kvblend_load`` and ``kvblend_store`` off, e.g. a full-prefill
    reference) must not make one; it is still logged, and claims nothing."""
    store_passages(client, tokenizer)
    ids, _ = prompt
    lookups = client.counters["lookups"]
    params = {"kvblend_load": False, "kvblend_store": False}
    assert make_scheduler().get_num_new_matched_tokens(FakeRequest("r", ids, params), 0) == (0, False)
    assert client.counters["lookups"] == lookups
    (lookup,) = [e for e in read_events(events_path) if e["event"] == "lookup"]
    assert (lookup["path"], lookup["num_segments"], lookup["request_id"]) == ("none", 0, "r")


def test_restricted_request_overrides_are_ignored_and_counted_when_not_allowed(make_scheduler, client, tokenizer,
                                                                                prompt, events_path):
    """Issue 19: with ``allow_request_overrides`` off, a request's ``kvblend_load: false`` does
    not stop the blend (it claims as a plain request does) and is counted once."""
    store_passages(client, tokenizer)
    ids, _ = prompt
    sched = make_scheduler(allow_request_overrides=False)
    plain, _ = sched.get_num_new_matched_tokens(FakeRequest("plain", ids), 0)
    assert plain > 0
    claim, _ = sched.get_num_new_matched_tokens(FakeRequest("r", ids, {"kvblend_load": False}), 0)
    assert claim == plain
    assert sched._counters.totals["ignored_overrides"] == 1
    allowed = make_scheduler(allow_request_overrides=True)  # turned on: honoured
    assert allowed.get_num_new_matched_tokens(FakeRequest("r2", ids, {"kvblend_load": False}), 0) == (0, False)


def test_recompute_ratio_and_sync_load_per_request(make_scheduler, client, tokenizer, prompt):
    store_passages(client, tokenizer)
    ids, spans = prompt
    sched = make_scheduler()
    req = FakeRequest("r", ids, {"kvblend_recompute_ratio": 0.25, "kvblend_load_async": False})
    assert sched.get_num_new_matched_tokens(req, 0) == (query_start(spans), False)
    sched.update_state_after_alloc(req, FakeBlocks(range(40)), query_start(spans))
    meta = sched.build_connector_meta(step(new=[("r", range(40), 0, len(ids))]))
    (load,) = meta.loads
    assert load.plan.recompute_ratios == (0.25,) * len(load.plan.check_layers)
    assert not load.load_async and meta.has_prefill


def test_a_requests_sync_load_and_ratio_are_ignored_by_default(client, tokenizer, prompt):
    """Issue 37: a scheduler built with the defaults (as the connector's options give it) blends
    a request that asks ``kvblend_load_async: false`` asynchronously, at the configured ratio."""
    store_passages(client, tokenizer)
    ids, spans = prompt
    config = load_config(environ={}, overrides={"min_tokens": 16, "chunk_size": CHUNK_SIZE})
    sched = KVBlendScheduler(config, client, namespace_digest=NAMESPACE, block_size=BLOCK_SIZE,
                             load_tokenizer=lambda: tokenizer, counters=Counters())
    req = FakeRequest("r", ids, {"kvblend_recompute_ratio": 0.25, "kvblend_load_async": False})
    assert sched.get_num_new_matched_tokens(req, 0) == (query_start(spans), True)
    sched.update_state_after_alloc(req, FakeBlocks(range(40)), query_start(spans))
    meta = sched.build_connector_meta(step(new=[("r", range(40), 0, len(ids))]))
    (load,) = meta.loads
    assert 0.25 not in load.plan.recompute_ratios and load.load_async
    assert sched._counters.totals["ignored_overrides"] == 1


def test_selection_per_request_reaches_the_plan(make_scheduler, client, tokenizer, prompt, caplog):
    """``kvblend_selection`` in kv_transfer_params picks the request's selection (issue 17);
    an unknown one is a full prefill with one log line, never an error."""
    store_passages(client, tokenizer)
    ids, spans = prompt
    sched = make_scheduler()
    req = FakeRequest("r", ids, {"kvblend_selection": "query_attention", "kvblend_load_async": False})
    assert sched.get_num_new_matched_tokens(req, 0) == (query_start(spans), False)
    sched.update_state_after_alloc(req, FakeBlocks(range(40)), query_start(spans))
    meta = sched.build_connector_meta(step(new=[("r", range(40), 0, len(ids))]))
    (load,) = meta.loads
    assert load.plan.selection == "query_attention" and load.plan.query_rows is not None
    assert make_scheduler().get_num_new_matched_tokens(
        FakeRequest("s", ids, {"kvblend_selection": "nope"}), 0) == (0, False)
    assert "kvblend_selection='nope'" in caplog.text


def test_a_bad_ratio_is_a_full_prefill_not_an_error(make_scheduler, client, tokenizer, prompt, caplog):
    store_passages(client, tokenizer)
    ids, _ = prompt
    sched = make_scheduler()
    assert sched.get_num_new_matched_tokens(FakeRequest("r", ids, {"kvblend_recompute_ratio": 1.5}), 0) == (0, False)
    assert sched._counters.totals["fallbacks"] == 1
    assert "kvblend_recompute_ratio=1.5 outside 0..1" in caplog.text
    assert sched.request_finished(FakeRequest("r", ids), []) == (False, None)


def test_a_lookup_that_raises_is_a_full_prefill(make_scheduler, caplog):
    class Broken(LocalCacheClient):
        def lookup(self, keys):
            raise ConnectionError("shard gone")

    ids = [1] + list(range(100, 200))  # no separator: the prefix path's lookup raises
    sched = make_scheduler(client=Broken())
    assert sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(FakeRequest("s", ids), 0) == (0, False)
    assert sched._counters.totals["fallbacks"] == 2
    assert caplog.text.count("kvblend: lookup failed (ConnectionError: shard gone)") == 1  # warned once


def test_unknown_kvblend_param_is_ignored_with_a_warning(make_scheduler, client, tokenizer, prompt, caplog):
    store_passages(client, tokenizer)
    ids, spans = prompt
    req = FakeRequest("r", ids, {"kvblend_lod": False, "other_connector_key": 1})
    assert make_scheduler().get_num_new_matched_tokens(req, 0)[0] == query_start(spans)
    assert "unknown kv_transfer_params key 'kvblend_lod'" in caplog.text
    assert "other_connector_key" not in caplog.text


def test_prompt_without_separators_takes_the_prefix_path(make_scheduler, client, events_path):
    ids = [1] + list(range(1000, 1000 + 4 * CHUNK_SIZE - 1))   # 4 chunks exactly
    keys = prefix_keys(NAMESPACE, ids, CHUNK_SIZE)
    assert len(keys) == 4
    for key in keys[:3]:
        store(client, key, CHUNK_SIZE)
    sched = make_scheduler()
    req = FakeRequest("r", ids)
    # 3 cached chunks, but never the last token: the 4th chunk (which holds it) is vLLM's
    assert sched.get_num_new_matched_tokens(req, 0) == (3 * CHUNK_SIZE, False)
    assert sched.get_num_new_matched_tokens(req, 2 * BLOCK_SIZE) == (3 * CHUNK_SIZE - 2 * BLOCK_SIZE, False)
    lookup = read_events(events_path)[0]
    assert (lookup["path"], lookup["num_prefix_hits"], lookup["num_store_prefix"]) == ("prefix", 3, 1)
    blocks = [7, 3, 11, 2, 9, 4, 8, 1]
    sched.update_state_after_alloc(req, FakeBlocks(blocks), 3 * CHUNK_SIZE - 2 * BLOCK_SIZE)
    # vLLM's new request counts the claimed tokens as computed; it schedules the 4th chunk
    meta = sched.build_connector_meta(step(new=[("r", blocks, 3 * CHUNK_SIZE, CHUNK_SIZE)]))
    (load,) = meta.loads
    assert (load.load_start, load.load_end, load.plan) == (2 * BLOCK_SIZE, 3 * CHUNK_SIZE, None)
    assert load.slot_mapping.tolist() == slots(blocks, 2 * BLOCK_SIZE, 3 * CHUNK_SIZE)
    assert load.prefix == [(k, i * CHUNK_SIZE, (i + 1) * CHUNK_SIZE) for i, k in enumerate(keys[:3])]
    (store_spec,) = meta.stores    # the 4th chunk is complete after this step's forward
    # and so is the whole prompt, stored as one segment too (issue 21: a passage sent alone)
    gathered = {k: key_slots.tolist() for k, key_slots in store_spec.prefix}
    assert gathered == {keys[3]: slots(blocks, 3 * CHUNK_SIZE, 4 * CHUNK_SIZE),
                        segment_key(NAMESPACE, ids): slots(blocks, 0, len(ids))}
    assert sched.request_finished(req, blocks) == (False, None)   # prefix puts need no held blocks


def test_prefix_chunks_are_stored_as_chunked_prefill_completes_them(make_scheduler):
    ids = list(range(500, 500 + 3 * CHUNK_SIZE + 5))
    sched = make_scheduler()
    req = FakeRequest("r", ids)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, FakeBlocks([]), 0)
    first = sched.build_connector_meta(step(new=[("r", [5, 6, 7], 0, 40)]))
    assert [k for s in first.stores for k, _ in s.prefix] == prefix_keys(NAMESPACE, ids, CHUNK_SIZE)[:1]
    second = sched.build_connector_meta(step(cached=[("r", [8, 9, 10, 11], 40, len(ids) - 40, False)]))
    ((whole, _), (_, first_slots), (_, second_slots)) = second.stores[0].prefix
    assert whole == segment_key(NAMESPACE, ids)    # the whole prompt, once computed (issue 21)
    blocks = [5, 6, 7, 8, 9, 10, 11]
    assert first_slots.tolist() == slots(blocks, CHUNK_SIZE, 2 * CHUNK_SIZE)
    assert second_slots.tolist() == slots(blocks, 2 * CHUNK_SIZE, 3 * CHUNK_SIZE)
    assert not first.loads and not second.loads and first.has_prefill and second.has_prefill


def test_async_load_is_sent_once_with_the_slots_of_the_allocated_blocks(make_scheduler, client, tokenizer,
                                                                        prompt):
    store_passages(client, tokenizer)
    ids, spans = prompt
    sched = make_scheduler()
    req = FakeRequest("r", ids)
    claim, _ = sched.get_num_new_matched_tokens(req, BLOCK_SIZE)
    blocks = list(range(100, 100 + len(ids) // BLOCK_SIZE + 1))[::-1]
    sched.update_state_after_alloc(req, FakeBlocks(blocks), claim)
    # vLLM parks the request (WAITING_FOR_REMOTE_KVS): it is not scheduled, its load is sent
    meta = sched.build_connector_meta(step())
    (load,) = meta.loads
    assert (load.load_start, load.load_end, load.load_async) == (BLOCK_SIZE, query_start(spans), True)
    assert load.slot_mapping.tolist() == slots(blocks, BLOCK_SIZE, query_start(spans))
    assert load.slot_mapping.dtype == torch.int64
    assert load.token_ids == tuple(ids[:query_start(spans)]) and load.plan.blend_end == query_start(spans)
    assert meta.idle and not meta.has_prefill
    assert sched._counters.totals["claimed_tokens"] == query_start(spans) - BLOCK_SIZE
    # after the load vLLM schedules the query: no second load
    later = sched.build_connector_meta(step(cached=[("r", None, query_start(spans), len(ids) - query_start(spans),
                                                     False)]))
    assert not later.loads and later.has_prefill


def test_request_finished_holds_blocks_while_segments_are_to_be_stored(make_scheduler, tokenizer, prompt,
                                                                     events_path):
    ids, _ = prompt
    other_ids, _ = build_blend_prompt(tokenizer, SYSTEM, [OTHER_PASSAGE], "Question: where?")
    sched = make_scheduler()
    held, early = FakeRequest("held", ids), FakeRequest("early", other_ids)
    for req in (held, early):
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, FakeBlocks(range(40)), 0)
    # + the system prompt (first segment: gathered after the forward, needs no held blocks), once
    assert [e["num_store_segments"] for e in read_events(events_path) if e["event"] == "lookup"] == [4, 1]
    # "early" finishes (aborted) before it is ever scheduled: its segment was never sent
    assert sched.request_finished(early, list(range(40))) == (False, None)
    meta = sched.build_connector_meta(step(new=[("held", range(40), 0, len(ids))]))
    assert [len(s.segments) for s in meta.stores] == [3]
    assert sched.request_finished(held, list(range(40))) == (True, None)
    assert sched.request_finished(FakeRequest("unknown", ids), []) == (False, None)


def test_store_kv_off_stores_nothing(make_scheduler, prompt):
    ids, _ = prompt
    sched = make_scheduler(store_kv=False)
    sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0)
    sched.update_state_after_alloc(FakeRequest("r", ids), FakeBlocks(range(40)), 0)
    assert not sched.build_connector_meta(step(new=[("r", range(40), 0, len(ids))])).stores
    assert sched.request_finished(FakeRequest("r", ids), []) == (False, None)


def test_under_tensor_parallelism_a_chunk_hits_only_when_every_rank_stored_it(make_scheduler, client,
                                                                              events_path):
    ranks = [NAMESPACE, make_namespace("rank1")]
    ids = [1] + list(range(2000, 2000 + 3 * CHUNK_SIZE))
    keys = [prefix_keys(r, ids, CHUNK_SIZE) for r in ranks]
    for rank_keys in keys:
        store(client, rank_keys[0], CHUNK_SIZE)
    store(client, keys[0][1], CHUNK_SIZE)       # rank 1 never stored chunk 1
    sched = make_scheduler(tp_size=2, client=AllRanksLookup(client, ranks))
    assert sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0) == (CHUNK_SIZE, False)
    assert read_events(events_path)[0]["num_prefix_hits"] == 1


def test_under_tensor_parallelism_blend_prompts_take_the_prefix_path(make_scheduler, client, tokenizer,
                                                                     prompt, events_path):
    store_passages(client, tokenizer)
    ids, _ = prompt
    sched = make_scheduler(tp_size=2, client=AllRanksLookup(client, [NAMESPACE, make_namespace("rank1")]))
    assert sched.get_num_new_matched_tokens(FakeRequest("r", ids), 0) == (0, False)
    lookup = read_events(events_path)[0]
    assert "num_prefix_chunks" in lookup and lookup["num_prefix_hits"] == 0


@pytest.mark.parametrize("flag", ["skip_reading_prefix_cache", "skip_reading_external_kv"])  # 0.32/0.33, 0.34
def test_prompt_logprob_requests_claim_nothing_with_request_overrides_off(make_scheduler, client, tokenizer,
                                                                          prompt, flag):
    """vLLM zeroes the claim of a request it computes whole (prompt logprobs); the half claims
    nothing for it with request overrides off, the default since issue 37 (the flag used to
    travel as a ``kvblend_load: false`` override, which was then ignored and counted)."""
    store_passages(client, tokenizer)
    ids, _ = prompt
    sched = make_scheduler(allow_request_overrides=False)
    assert sched.get_num_new_matched_tokens(FakeRequest("plain", ids), 0)[0] > 0
    scored = FakeRequest("scored", ids)
    setattr(scored, flag, True)
    assert sched.get_num_new_matched_tokens(scored, 0) == (0, False)
    assert sched._counters.totals.get("ignored_overrides", 0) == 0
