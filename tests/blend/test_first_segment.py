"""Issue 21 (c): a prompt's first segment is a chunk like any passage — planned, looked up and
keyed as one — and only the BOS its tokenizer adds stays a prefix. With the real SmolLM2
tokenizer (adds no BOS) and a Llama-style stand-in that does."""

from __future__ import annotations

import pytest

from blend.config import BlendConfig
from blend.plan import CHUNK, PREFIX, QUERY, SEPARATOR
from blend.planner import make_plan
from blend.segments import (
    build_blend_prompt,
    chunk_token_ids,
    find_segments,
    first_segment_as_chunk,
    special_tokens_around,
    standalone_span,
)
from tests.factories import NAMESPACE
from tiers.keys import segment_key

pytestmark = pytest.mark.unit

SEP = " # # "
P1 = "Lighthouse keepers on Varo island logged each ship that passed the strait."
P2 = "The cathedral of Mena was rebuilt twice after fires, in 1702 and in 1788."


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


class BosTokenizer:
    """SmolLM2's tokenizer adding BOS (id 1) before every text it encodes with special
    tokens, as Llama's does."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + self.inner.encode(text, add_special_tokens=False)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Cached:
    """A source holding some keys (canonical positions)."""

    def __init__(self, lengths: dict) -> None:
        self.lengths = lengths

    def lookup(self, keys):
        from types import SimpleNamespace

        return [SimpleNamespace(num_tokens=self.lengths[k], positions=tuple(range(self.lengths[k])), tier="host")
                if k in self.lengths else None for k in keys]


def test_special_tokens_around(tokenizer):
    assert special_tokens_around(tokenizer) == ((), ())
    assert special_tokens_around(BosTokenizer(tokenizer)) == ((1,), ())


def test_standalone_span_drops_only_the_added_specials():
    ids = [1, 50, 51, 2]
    assert standalone_span(ids, 0, 4, ((1,), (2,))) == (1, 3)
    assert standalone_span(ids, 0, 4, ((), ())) == (0, 4)
    assert standalone_span(ids, 1, 4, ((1,), ())) == (1, 4)      # not at the start: nothing to drop
    assert standalone_span([1], 0, 1, ((1,), ())) == (1, 1)      # nothing left


def test_first_segment_becomes_a_chunk_without_bos(tokenizer):
    ids, spans = build_blend_prompt(tokenizer, P1, [P2], "Question?", separator=SEP, add_bos=False)
    assert spans[0] == (PREFIX, 0, len(chunk_token_ids(tokenizer, P1)))
    out = first_segment_as_chunk(spans, ids, special_tokens_around(tokenizer))
    assert out[0] == (CHUNK, 0, spans[0][2]) and out[1:] == spans[1:]
    assert list(ids[:spans[0][2]]) == chunk_token_ids(tokenizer, P1)   # the standalone chunk's ids


def test_first_segment_keeps_the_added_bos_as_prefix(tokenizer):
    bos = BosTokenizer(tokenizer)
    ids, spans = build_blend_prompt(tokenizer, P1, [P2], "Question?", separator=SEP, add_bos=False)
    ids = [1] + ids
    spans = find_segments(ids, tokenizer, SEP)
    out = first_segment_as_chunk(spans, ids, special_tokens_around(bos))
    assert out[:2] == [(PREFIX, 0, 1), (CHUNK, 1, spans[0][2])]
    assert list(ids[1:spans[0][2]]) == chunk_token_ids(tokenizer, P1)


def test_spans_without_separator_or_first_segment_stay(tokenizer):
    ids = chunk_token_ids(tokenizer, P1)
    assert first_segment_as_chunk([(PREFIX, 0, len(ids))], ids) == [(PREFIX, 0, len(ids))]
    spans = [(SEPARATOR, 0, 3), (QUERY, 3, 9)]
    assert first_segment_as_chunk(spans, list(range(9))) == spans
    assert first_segment_as_chunk([], []) == []


def test_a_cached_chunk_hits_in_first_position_and_a_first_passage_elsewhere(tokenizer):
    """``P1 ⟨sep⟩ P2 ⟨sep⟩ q`` (no system prompt) and ``P2 ⟨sep⟩ P1 ⟨sep⟩ q``: both passages, once
    cached under their chunk keys, hit in either position."""
    cfg = BlendConfig(min_tokens=1)
    k1 = segment_key(NAMESPACE, chunk_token_ids(tokenizer, P1))
    k2 = segment_key(NAMESPACE, chunk_token_ids(tokenizer, P2))
    source = Cached({k1: len(chunk_token_ids(tokenizer, P1)), k2: len(chunk_token_ids(tokenizer, P2))})
    for first, second in ((P1, P2), (P2, P1)):
        ids, spans = build_blend_prompt(tokenizer, first, [second], "Which year?", separator=SEP, add_bos=False)
        plan = make_plan(ids, first_segment_as_chunk(spans, ids), NAMESPACE, source, cfg)
        assert plan.blend, plan.full_prefill_reason
        hits = plan.hit_segments
        assert [s.key for s in hits] == [segment_key(NAMESPACE, chunk_token_ids(tokenizer, p)) for p in (first, second)]
        assert hits[0].start == 0 and hits[0].stored_positions == tuple(range(hits[0].num_tokens))
        # without the promotion the first passage is a prefix: computed, never looked up
        assert len(make_plan(ids, spans, NAMESPACE, source, cfg).hit_segments) == 1


def test_a_missed_first_segment_is_a_missed_chunk(tokenizer):
    ids, spans = build_blend_prompt(tokenizer, P1, [P2], "Which year?", separator=SEP, add_bos=False)
    plan = make_plan(ids, first_segment_as_chunk(spans, ids), NAMESPACE, Cached({}), BlendConfig(min_tokens=1))
    assert [(s.start, s.key) for s in plan.missed_segments][0] == (0, segment_key(NAMESPACE, ids[:spans[0][2]]))
    assert plan.full_prefill_reason.startswith("fewer than min_tokens")
