"""Segments, canonical tokenization and the planner, with the real SmolLM2 tokenizer.

Cases: ../shared/cases/separator-in-context.md, separator-edges.md, hits-after-a-miss.md.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

from blend.config import DEFAULT_SEPARATOR, BlendConfig
from blend.planner import make_plan
from blend.segments import build_blend_prompt, chunk_token_ids, find_segments, split_text
from tests.factories import F32_TOL, NAMESPACE, blend_prompt, plan_for, random_chunks, store_chunks
from tiers.keys import segment_key

pytestmark = pytest.mark.unit

QA = "/work/shared/data/qa/musique_s.norm.jsonl"
LMCACHE_SEP = " # # "


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _passages(num_rows=4):
    import os

    path = QA if os.path.exists(QA) else None
    if path is None:
        pytest.skip("QA data not present")
    with open(path) as fh:
        rows = [json.loads(next(fh)) for _ in range(num_rows)]
    return rows


def _chunks_of(ids, spans):
    return [ids[s:e] for kind, s, e in spans if kind == "chunk"]


def test_separator_in_context(tokenizer):
    """The default separator: every passage keeps its standalone ids inside the whole
    string, in any order; the prompt string tokenized at once has all segments."""
    for row in _passages(3):
        passages, question = row["passages"], row["question"]
        for order in (passages, passages[::-1]):
            text = DEFAULT_SEPARATOR.join(["You answer questions.", *order, question])
            ids = tokenizer.encode(text, add_special_tokens=False)
            spans = find_segments(ids, tokenizer, DEFAULT_SEPARATOR)
            found = _chunks_of(ids, spans)
            assert found == [chunk_token_ids(tokenizer, p) for p in order]
            assert [k for k, _, _ in spans][0] == "prefix" and spans[-1][0] == "query"


def test_lmcache_separator_found_in_every_form(tokenizer):
    """' # # ' merges with its neighbours in context; segments are still found (the chunk
    ids may lose a boundary token, which is why it is not the default), and prompts built
    per piece hit exactly."""
    passages = ["first passage text here", "you are the second one", "a third"]
    text = "sys" + LMCACHE_SEP + LMCACHE_SEP.join(passages) + LMCACHE_SEP + "question?"
    for ids in (tokenizer.encode(text, add_special_tokens=False),
                [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False),
                tokenizer.encode(text.replace("sys", "", 1), add_special_tokens=False)):
        spans = find_segments(ids, tokenizer, LMCACHE_SEP)
        chunks = _chunks_of(ids, spans)
        assert len(chunks) == 3
        for chunk, passage in zip(chunks, passages, strict=True):
            assert passage.strip() in tokenizer.decode(chunk) or tokenizer.decode(chunk).strip() in passage
    ids, spans = build_blend_prompt(tokenizer, "sys", passages, "question?", separator=LMCACHE_SEP)
    assert _chunks_of(ids, spans) == [chunk_token_ids(tokenizer, p) for p in passages]
    assert find_segments(ids, tokenizer, LMCACHE_SEP) == spans


def test_build_blend_prompt_agrees_with_find_segments(tokenizer):
    row = _passages(1)[0]
    ids, spans = build_blend_prompt(tokenizer, "Answer briefly.", row["passages"][:4], row["question"])
    assert ids[0] == tokenizer.bos_token_id
    assert find_segments(ids, tokenizer, DEFAULT_SEPARATOR) == spans
    assert [k for k, _, _ in spans] == ["prefix"] + ["sep", "chunk"] * 4 + ["sep", "query"]
    assert split_text(tokenizer.decode(ids[1:]), DEFAULT_SEPARATOR)[1] == row["passages"][0]


def test_separator_edges_segments(tokenizer):
    sep = DEFAULT_SEPARATOR
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    # first and last thing in the prompt
    spans = find_segments(enc(sep + "alpha beta" + sep), tokenizer, sep)
    assert [k for k, _, _ in spans] == ["sep", "chunk", "sep"]
    # two separators in a row: an empty segment is no segment
    spans = find_segments(enc("sys" + sep + sep + "alpha" + sep + "q"), tokenizer, sep)
    assert [k for k, _, _ in spans] == ["prefix", "sep", "chunk", "sep", "query"]
    # no separator
    ids = enc("just a question")
    assert find_segments(ids, tokenizer, sep) == [("prefix", 0, len(ids))]
    with pytest.raises(ValueError, match="separator"):
        find_segments(ids, tokenizer, "")


def test_planner_lookup_is_one_batch_and_keys_are_canonical(tokenizer):
    class Source:
        calls = []

        def lookup(self, keys):
            self.calls.append(list(keys))
            return [None] * len(keys)

        def fetch_layers(self, keys, layer_idxs):
            raise AssertionError("not reached")

    src = Source()
    ids, spans = build_blend_prompt(tokenizer, "s", ["one two", "three four"], "q")
    plan = make_plan(ids, spans, NAMESPACE, src, BlendConfig())
    assert len(src.calls) == 1
    assert src.calls[0] == [segment_key(NAMESPACE, chunk_token_ids(tokenizer, t)) for t in ("one two", "three four")]
    assert plan.full_prefill_reason == "fewer than min_tokens reusable tokens: 0 < 256"


def test_separator_edges(make_setup):
    """separator-edges at the planner/engine level: first/last, empty segment, no separator,
    a short segment in a long enough prompt, a prompt below min_tokens, too long a prompt."""
    engine, client = make_setup()
    chunks = random_chunks(3, 20)
    store_chunks(engine, client, chunks)
    sep = [7, 8]
    # separator first (no prefix) and last (no query): blend_end leaves >= 1 token
    ids, spans = blend_prompt([], chunks, [])
    assert spans[0][0] == "sep" and spans[-1][0] == "sep"
    plan = plan_for(ids, spans, client, ratio=1.0, query_to_engine=False)
    assert plan.blend_end == len(ids) - 1 and plan.blend
    res = engine.blend(plan, want_logits=False)
    full = engine.prefill(ids[:-1], want_logits=False)
    assert_close(res.kv[-1], full.kv[-1], **F32_TOL)
    # empty segment between two separators
    ids = [1, 2] + sep + sep + chunks[0] + sep + [4, 5]
    spans = [("prefix", 0, 2), ("sep", 2, 6), ("chunk", 6, 26), ("sep", 26, 28), ("query", 28, 30)]
    res = engine.blend(plan_for(ids, spans, client, ratio=1.0))
    assert res.counters.num_hit_segments == 1
    assert_close(res.logits, engine.prefill(ids).logits, **F32_TOL)
    # no separator: full prefill, said so
    ids = chunks[0] + [4, 5]
    plan = plan_for(ids, [("prefix", 0, len(ids))], client)
    assert plan.full_prefill_reason == "no separator"
    res = engine.blend(plan)
    assert res.counters.full_prefill_reason == "no separator" and res.counters.reused_tokens == 0
    assert_close(res.logits, engine.prefill(ids).logits, **F32_TOL)
    # a segment shorter than min_tokens is still reused when the whole prompt has enough
    short = chunks[0][:5]
    store_chunks(engine, client, [short])
    ids, spans = blend_prompt([1], [short] + chunks, [4])
    plan = plan_for(ids, spans, client, min_tokens=60)
    assert plan.blend and all(s.hit for s in plan.segments if s.kind == "chunk")
    # the whole prompt's reusable part below min_tokens: skipped, stated
    plan = plan_for(ids, spans, client, min_tokens=66)
    assert plan.full_prefill_reason == "fewer than min_tokens reusable tokens: 65 < 66"
    assert engine.blend(plan).counters.full_prefill_reason == plan.full_prefill_reason
    # longer than the context window: a clear error, nothing stored
    engine_short, client_short = make_setup(max_position=64)
    long_chunk = random_chunks(1, 70)[0]
    with pytest.raises(ValueError, match="context window"):
        store_chunks(engine_short, client_short, [long_chunk])
    assert client_short.stats()["tiers"]["host"]["num_chunks"] == 0


def test_source_unavailable():
    class Dead:
        def lookup(self, keys):
            raise ConnectionError("shard down")

    ids, spans = blend_prompt([1], random_chunks(2, 10), [4])
    plan = make_plan(ids, spans, NAMESPACE, Dead(), BlendConfig(min_tokens=0))
    assert plan.full_prefill_reason == "source unavailable"
    assert make_plan(ids, spans, NAMESPACE, None, BlendConfig()).full_prefill_reason == "source unavailable"


def test_smollm2_ratio_one_and_layers_match(smollm2_path, tokenizer):
    """SmolLM2 in float32 on a short prompt: ratio 1.0 = full prefill (KV and logits) and the
    engine's prefill = HF's forward. Tolerance: float32, 30 layers, O(10) activations:
    rtol=atol=1e-3 (observed ~1e-5)."""
    from blend.adapters.hf import HFModelAdapter
    from blend.engine import BlendEngine
    from cluster.cache.local import LocalCacheClient

    adapter = HFModelAdapter.from_pretrained(smollm2_path, dtype=torch.float32)
    client = LocalCacheClient()
    engine = BlendEngine(adapter, client)
    passages = ["Paris is the capital of France.", "The Seine flows through Paris.",
                "Berlin is the capital of Germany."]
    store_chunks(engine, client, [chunk_token_ids(tokenizer, p) for p in passages])
    ids, spans = build_blend_prompt(tokenizer, "Answer briefly.", passages[::-1], "What is the capital of France?")
    tol = dict(rtol=1e-3, atol=1e-3)
    plan = plan_for(ids, spans, client, ratio=1.0)
    res = engine.blend(plan)
    full = engine.prefill(ids)
    assert res.counters.num_hit_segments == 3
    assert_close(res.logits, full.logits, **tol)
    for got, want in zip(res.kv, full.kv, strict=True):
        assert_close(got, want, **tol)
    with torch.no_grad():
        hf_logits = adapter.model(torch.tensor([ids])).logits[0, -1]
    assert_close(full.logits, hf_logits, **tol)
    part = engine.blend(plan_for(ids, spans, client, ratio=0.15))
    for layer in range(2):
        assert_close(part.kv[layer], full.kv[layer], **tol)
    assert part.counters.selected_tokens < part.counters.reused_tokens
