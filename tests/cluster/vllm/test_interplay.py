"""The connector with vLLM's scheduling features (issue 6, "Interplay"): the async-load path
next to a decoding request, an abort during an async load, preemption of a blended request,
chunked prefill of a blended request's query. In-process engine (``blend_llm``: float32,
prefix caching off, ``max_num_batched_tokens`` 1024), driven step by step through
``LLMEngine.add_request``/``step``; the oracle is vLLM's own full prefill of the same prompt.
"""

from __future__ import annotations

import pytest

from blend.segments import build_blend_prompt
from tests.cluster.vllm.helpers import (
    FULL,
    SYSTEM,
    assert_matches_full,
    events,
    generate,
    generate_and_store,
    passage,
    settle,
)

pytestmark = pytest.mark.engine

PLAIN = {"kvblend_load": False, "kvblend_store": False}


def _params(max_tokens: int, kv_params: dict | None = None, **kw):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    if kv_params is not None:
        sp.extra_args = {"kv_transfer_params": kv_params}
    return sp


def _cached_prompt(llm, stats_path, tokenizer, seed: int, question: str):
    """Three passages (and the system prompt) stored by a cold request; the reordered prompt that hits them all."""
    texts = [passage(seed + i, num_sentences=10) for i in range(3)]
    warm, _ = build_blend_prompt(tokenizer, SYSTEM, texts, "Question: warm?")
    generate_and_store(llm, stats_path, warm)
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, [texts[2], texts[0], texts[1]], question)
    return ids


def _one_step_per_layer(monkeypatch):
    """The worker advances an async blend by one layer per engine step that runs others."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    monkeypatch.setattr(get_kv_transfer_group().connector_worker, "load_step_s", 1e-9)


def _decoded_during_blend(llm, tokenizer, ids, load_async: bool, tag: str):
    """A plain request decodes; the blended one arrives. Returns (tokens the plain request
    got from the blended request's arrival to the blended request's first token, the
    blended request's output)."""
    engine = llm.llm_engine
    plain = tokenizer.encode("Count from one to one hundred: one, two, three, four,")
    engine.add_request(f"plain-{tag}", {"prompt_token_ids": plain}, _params(64, PLAIN, ignore_eos=True))
    plain_tokens = 0
    for out in engine.step():  # the plain request's prefill: it decodes from now on
        plain_tokens = len(out.outputs[0].token_ids)
    assert plain_tokens == 1
    engine.add_request(f"blend-{tag}", {"prompt_token_ids": ids},
                       _params(6, {"kvblend_load_async": load_async}, logprobs=5))
    at_first_token = None
    blended = None
    while engine.has_unfinished_requests():
        step_outs = engine.step()
        for out in step_outs:
            if out.request_id.startswith("plain"):
                plain_tokens = len(out.outputs[0].token_ids)
        for out in step_outs:
            if out.request_id.startswith("blend"):
                if at_first_token is None and out.outputs[0].token_ids:
                    at_first_token = plain_tokens
                if out.finished:
                    blended = out
    settle(llm)
    assert blended is not None and at_first_token is not None
    return at_first_token - 1, blended


def test_async_blend_keeps_other_requests_decoding(blend_llm, blend_stats_path, tokenizer, monkeypatch):
    """vLLM's async-load path: while a blend runs (one layer per engine step here), a request
    already decoding keeps getting a token every step; on the synchronous path the blend runs
    inside one step and the decoding request waits for it. Both equal full prefill."""
    ids = _cached_prompt(blend_llm, blend_stats_path, tokenizer, 1100, "Question: which item is 11001? Answer:")
    _one_step_per_layer(monkeypatch)
    num_layers = blend_llm.llm_engine.model_config.hf_config.num_hidden_layers
    ref = generate(blend_llm, ids, FULL)

    gained_async, out_async = _decoded_during_blend(blend_llm, tokenizer, ids, True, "a")
    load = events(blend_stats_path, "blend-a", "load")
    assert len(load) == 1 and load[0]["load_async"] and not load[0]["fallback"]
    assert load[0]["num_hit_segments"] == 4  # the system prompt and 3 passages
    assert load[0]["engine_steps"] >= num_layers and load[0]["busy_steps"] >= num_layers
    assert gained_async >= num_layers  # a decode step per blended layer
    assert_matches_full(out_async, ref)

    gained_sync, out_sync = _decoded_during_blend(blend_llm, tokenizer, ids, False, "s")
    load = events(blend_stats_path, "blend-s", "load")
    assert len(load) == 1 and not load[0]["load_async"] and load[0]["engine_steps"] == 1
    assert gained_sync <= 1
    assert_matches_full(out_sync, ref)


def test_abort_during_async_load_frees_the_blocks(blend_llm, blend_stats_path, tokenizer, monkeypatch):
    """A request aborted while its blend is half done: the worker abandons it and reports it
    in ``finished_recving``, vLLM frees its blocks; the next request blends normally."""
    ids = _cached_prompt(blend_llm, blend_stats_path, tokenizer, 1200, "Question: which item is 12001? Answer:")
    _one_step_per_layer(monkeypatch)
    engine = blend_llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    engine.add_request("plain-ab", {"prompt_token_ids": tokenizer.encode("One, two, three,")},
                       _params(40, PLAIN, ignore_eos=True))
    engine.step()
    engine.add_request("abort-me", {"prompt_token_ids": ids}, _params(4))
    for _ in range(4):
        engine.step()
    assert not events(blend_stats_path, "abort-me", "load")  # still loading
    engine.abort_request(["abort-me"])
    while engine.has_unfinished_requests():
        engine.step()
    settle(blend_llm)
    (load,) = events(blend_stats_path, "abort-me", "load")
    num_layers = blend_llm.llm_engine.model_config.hf_config.num_hidden_layers
    assert load["aborted"] and 1 <= load["engine_steps"] < num_layers
    assert not scheduler.requests and scheduler.kv_cache_manager.usage == 0.0
    out = generate(blend_llm, ids)
    (load,) = events(blend_stats_path, out.request_id, "load")
    assert load["num_hit_segments"] == 4 and not load["fallback"]
    assert_matches_full(out, generate(blend_llm, ids, FULL))


def test_preempted_blended_request_is_blended_again(blend_llm, blend_stats_path, tokenizer):
    """Preemption (vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts every
    running request) after the blended request decoded two tokens: vLLM asks the connector
    again, the request is blended a second time, and its tokens equal full prefill's."""
    ids = _cached_prompt(blend_llm, blend_stats_path, tokenizer, 1300, "Question: which item is 13001? Answer:")
    engine = blend_llm.llm_engine
    engine.add_request("preempt-me", {"prompt_token_ids": ids}, _params(6, logprobs=5))
    tokens = 0
    while tokens < 2:
        for out in engine.step():
            tokens = len(out.outputs[0].token_ids)
    assert blend_llm.reset_prefix_cache(reset_running_requests=True)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    settle(blend_llm)
    loads = events(blend_stats_path, "preempt-me", "load")
    assert len(loads) == 2 and all(ld["num_hit_segments"] == 4 and not ld["fallback"] for ld in loads)
    assert final is not None
    assert_matches_full(final, generate(blend_llm, ids, FULL))


def test_chunked_prefill_of_a_blended_query(blend_llm, blend_stats_path, tokenizer, monkeypatch):
    """A query longer than ``max_num_batched_tokens`` after the blended passages: vLLM
    computes it in several chunks over the blended KV; the output equals full prefill."""
    budget = blend_llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    question = "Question: " + passage(1400, num_sentences=40) + " Which item is 14001? Answer:"
    ids = _cached_prompt(blend_llm, blend_stats_path, tokenizer, 1410, question)
    scheduler = blend_llm.llm_engine.engine_core.engine_core.scheduler
    scheduled: list[int] = []
    real = scheduler.schedule

    def spy(*a, **kw):
        out = real(*a, **kw)
        scheduled.extend(n for rid, n in out.num_scheduled_tokens.items() if rid.startswith("chunked"))
        return out

    monkeypatch.setattr(scheduler, "schedule", spy)
    blend_llm.llm_engine.add_request("chunked", {"prompt_token_ids": ids}, _params(6, logprobs=5))
    final = None
    while blend_llm.llm_engine.has_unfinished_requests():
        for out in blend_llm.llm_engine.step():
            if out.finished:
                final = out
    monkeypatch.undo()
    settle(blend_llm)
    (lookup,) = events(blend_stats_path, "chunked", "lookup")
    (load,) = events(blend_stats_path, "chunked", "load")
    assert lookup["path"] == "blend" and load["num_hit_segments"] == 4 and not load["fallback"]
    tail = len(ids) - load["load_end"]
    assert tail > budget
    prefill_steps = [n for n in scheduled if n > 1]
    assert len(prefill_steps) >= 2 and sum(prefill_steps) == tail and max(prefill_steps) <= budget
    assert_matches_full(final, generate(blend_llm, ids, FULL))
