"""Issue 21 at the scheduler half: LMCache's recipes precompute a chunk by sending it alone
(``chunk``) or after the system prompt (``system ⟨sep⟩ chunk``), and prompts may have no
system prompt (``passage ⟨sep⟩ passage ⟨sep⟩ question``). Each test checks what is stored under
which segment key, by which route (gathered from the paged cache after the forward when it
starts at token 0, else computed canonically by the worker), and what later hits.

Engine-free, as ``test_scheduler.py``: a fake request, blocks and scheduler output, a
:class:`~cluster.cache.local.LocalCacheClient`, the real SmolLM2 tokenizer (adds no BOS) and a
Llama-style stand-in that adds one.
"""

from __future__ import annotations

import pytest

from blend.segments import build_blend_prompt, chunk_token_ids
from cluster.config import load_config
from cluster.vllm.events import EventLog, read_events
from cluster.vllm.metrics import Counters
from cluster.vllm.scheduler import KVBlendScheduler
from tests.cluster.vllm.test_scheduler import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    FakeBlocks,
    FakeRequest,
    slots,
    step,
    store,
)
from tests.factories import NAMESPACE
from tiers.keys import segment_key

pytestmark = pytest.mark.unit

SEP = " # # "
SYSTEM = "You are a very helpful assistant."
CHUNKS = ["Hello, how are you?" * 6, "Hello, what's up?" * 6, "Hey, how can i do" * 6]
BLOCKS = list(range(60))


class BosTokenizer:
    """SmolLM2's tokenizer adding BOS (id 1) when asked for special tokens, as Llama's does."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + self.inner.encode(text, add_special_tokens=False)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def make_scheduler(tokenizer, client, events_path):
    def make(tok=None, tp_size: int = 1, **overrides) -> KVBlendScheduler:
        config = load_config(environ={}, overrides={"min_tokens": 16, "chunk_size": CHUNK_SIZE,
                                                    "blend_separator": SEP, **overrides})
        return KVBlendScheduler(config, client, namespace_digest=NAMESPACE, block_size=BLOCK_SIZE,
                                load_tokenizer=lambda: tok or tokenizer, tp_size=tp_size,
                                allow_request_overrides=True,  # kvblend_store below (#37)
                                events=EventLog(events_path), counters=Counters())

    return make


def run_prompt(sched, rid: str, ids, params=None):
    """Look ``ids`` up, allocate, schedule its whole prefill in one step: the step's stores."""
    req = FakeRequest(rid, list(ids), params)
    claim, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, FakeBlocks(BLOCKS), claim)
    meta = sched.build_connector_meta(step(new=[(rid, BLOCKS, claim, len(ids) - claim)]))
    gathered = {k: s.tolist() for spec in meta.stores for k, s in spec.prefix}
    computed = {k: list(t) for spec in meta.stores for k, t in spec.segments}
    return claim, gathered, computed


def seg(tokenizer, text: str):
    return segment_key(NAMESPACE, chunk_token_ids(tokenizer, text))


def test_a_prompt_without_separator_is_stored_as_that_chunk(make_scheduler, tokenizer, events_path):
    """(a) SmolLM2 adds no BOS: the prompt's KV in the paged cache is the chunk's canonical KV,
    gathered after the forward, under the key a segment of the same text has in a blend prompt."""
    ids = chunk_token_ids(tokenizer, CHUNKS[1])
    _, gathered, computed = run_prompt(make_scheduler(), "r", ids)
    assert gathered[seg(tokenizer, CHUNKS[1])] == slots(BLOCKS, 0, len(ids)) and not computed
    lookup = read_events(events_path)[0]
    assert (lookup["path"], lookup["num_standalone_segments"]) == ("none", 1)


def test_with_a_bos_tokenizer_the_chunk_after_bos_is_computed_canonically(make_scheduler, tokenizer):
    """(a) With BOS the prompt's KV sat after the BOS: the chunk's ids (without it) are computed
    by the worker at positions 0..n-1 instead."""
    bos = BosTokenizer(tokenizer)
    ids = bos.encode(CHUNKS[1])
    claim, gathered, computed = run_prompt(make_scheduler(tok=bos), "r", ids)
    assert computed == {seg(tokenizer, CHUNKS[1]): chunk_token_ids(tokenizer, CHUNKS[1])}
    assert seg(tokenizer, CHUNKS[1]) not in gathered


def test_lmcache_precompute_then_blend_hits_every_chunk(make_scheduler, tokenizer, client, events_path):
    """LMCache's blend_online_client: ``sys ⟨sep⟩ c1``, ``c2``, ``c3`` precomputed, then
    ``sys ⟨sep⟩ c2 ⟨sep⟩ c1 ⟨sep⟩ c3 ⟨sep⟩ q`` (as tokenized segment-wise) hits all of them."""
    sched = make_scheduler()
    first, _ = build_blend_prompt(tokenizer, SYSTEM, [], CHUNKS[0], separator=SEP, add_bos=False)
    _, gathered, computed = run_prompt(sched, "p0", first)
    assert set(gathered) == {seg(tokenizer, SYSTEM)}                  # first segment, at token 0
    assert computed == {seg(tokenizer, CHUNKS[0]): chunk_token_ids(tokenizer, CHUNKS[0])}  # the tail
    for i in (1, 2):
        _, gathered, _ = run_prompt(sched, f"p{i}", chunk_token_ids(tokenizer, CHUNKS[i]))
        assert seg(tokenizer, CHUNKS[i]) in gathered
    for text in [SYSTEM, *CHUNKS]:                                   # the worker stores them
        store(client, seg(tokenizer, text), len(chunk_token_ids(tokenizer, text)))
    ids, spans = build_blend_prompt(tokenizer, SYSTEM, [CHUNKS[1], CHUNKS[0], CHUNKS[2]], "Hello, how are you?",
                                    separator=SEP, add_bos=False)
    claim, gathered, computed = run_prompt(sched, "blend", ids)
    query = [s for kind, s, _ in spans if kind == "query"][0]
    assert claim == query and not gathered and not computed
    lookup = [e for e in read_events(events_path) if e["event"] == "lookup"][-1]
    assert (lookup["path"], lookup["num_segments"], lookup["num_hit_segments"]) == ("blend", 4, 4)


def test_a_query_after_chunks_is_not_stored(make_scheduler, tokenizer):
    """Only a prompt with no chunk between separators has its last segment stored: a question
    after passages is not a passage."""
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, [CHUNKS[0]], "Hello, how are you?", separator=SEP, add_bos=False)
    _, gathered, computed = run_prompt(make_scheduler(), "r", ids)
    assert set(gathered) == {seg(tokenizer, SYSTEM)}
    assert set(computed) == {seg(tokenizer, CHUNKS[0])}


def test_no_system_prompt_first_passage_is_reused_elsewhere_and_a_chunk_first(make_scheduler, tokenizer,
                                                                            client, events_path):
    """(c) ``c0 ⟨sep⟩ c1 ⟨sep⟩ q``: c0 (first, missed) is gathered under its chunk key; once stored,
    ``c1 ⟨sep⟩ c0 ⟨sep⟩ q`` hits c0 in second position and c1 in first position."""
    sched = make_scheduler()
    ids, spans = build_blend_prompt(tokenizer, CHUNKS[0], [CHUNKS[1]], "Which one?", separator=SEP, add_bos=False)
    claim, gathered, computed = run_prompt(sched, "a", ids)
    assert claim == 0
    assert gathered == {seg(tokenizer, CHUNKS[0]): slots(BLOCKS, 0, spans[0][2])}
    assert set(computed) == {seg(tokenizer, CHUNKS[1])}
    for text in CHUNKS[:2]:
        store(client, seg(tokenizer, text), len(chunk_token_ids(tokenizer, text)))
    ids, spans = build_blend_prompt(tokenizer, CHUNKS[1], [CHUNKS[0]], "Which one?", separator=SEP, add_bos=False)
    claim, gathered, computed = run_prompt(sched, "b", ids)
    assert claim == [s for kind, s, _ in spans if kind == "query"][0] and not gathered and not computed
    lookup = [e for e in read_events(events_path) if e["event"] == "lookup"][-1]
    assert (lookup["num_segments"], lookup["num_hit_segments"]) == (2, 2)
    hits = sched._requests["b"].plan.hit_segments
    assert [(h.start, h.key) for h in hits] == [(0, seg(tokenizer, CHUNKS[1])),
                                               (spans[2][1], seg(tokenizer, CHUNKS[0]))]


@pytest.mark.parametrize("overrides, params", [
    ({"engine_type": "prefix"}, None),
    ({"enable_blending": False}, None),
    ({}, {"kvblend_store": False}),
])
def test_nothing_standalone_when_blending_or_storing_is_off(make_scheduler, tokenizer, overrides, params):
    ids = chunk_token_ids(tokenizer, CHUNKS[2])
    _, gathered, computed = run_prompt(make_scheduler(**overrides), "r", ids, params)
    assert seg(tokenizer, CHUNKS[2]) not in gathered and not computed


def test_nothing_standalone_under_tensor_parallelism(make_scheduler, tokenizer):
    ids = chunk_token_ids(tokenizer, CHUNKS[2])
    _, gathered, computed = run_prompt(make_scheduler(tp_size=2), "r", ids)
    assert seg(tokenizer, CHUNKS[2]) not in gathered and not computed


def test_a_chunk_is_stored_once_per_process(make_scheduler, tokenizer):
    sched = make_scheduler()
    ids = chunk_token_ids(tokenizer, CHUNKS[1])
    assert seg(tokenizer, CHUNKS[1]) in run_prompt(sched, "a", ids)[1]
    assert seg(tokenizer, CHUNKS[1]) not in run_prompt(sched, "b", ids)[1]
