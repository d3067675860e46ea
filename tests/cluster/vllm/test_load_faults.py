"""Issue 6 test 6: faults injected deterministically during a load, through vLLM.

The in-process engine (``blend_llm``, ratio 1.0) gets Ray cache clients in place of its
process-local cache: one Ray node with one shard (host memory, write-through to a Redis tier
shared by all shards). A cold request stores three passages through the shard; a *fresh*
client (nothing mapped, as another replica's) serves the reordered request, and its first
layer read kills the shard (and, in the second test, Redis too) before reading — or freezes
them with SIGSTOP (a retrieve that never answers must not park the request: LMCache PR #5047).
"""

from __future__ import annotations

import contextlib
import time

import pytest

from blend.segments import build_blend_prompt
from cluster.workloads.faults import sigstopped
from tests.cluster.vllm.helpers import (
    FULL,
    SYSTEM,
    assert_matches_full,
    events,
    generate,
    one_node_ray_cache,
    passage,
    use_client,
    wait_restarted,
    wait_stored,
)
from tests.factories import wait_gone

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def ray_redis_cache(redis_server, tmp_path_factory):
    """``(config, shard name)``: a one-node Ray cluster with one shard over Redis."""
    from cluster.config import load_config

    with one_node_ray_cache(tmp_path_factory.mktemp("raycache_faults"), disk_size_gib=0,
                            redis_url=redis_server.url, call_timeout_s=3.0) as (overrides, names):
        (name,) = names
        yield load_config(environ={}, overrides=overrides), name


def _blend_with_faults(llm, stats_path, tokenizer, config, shard, monkeypatch, seed: int, redis=None,
                       freeze: bool = False, load_timeout_s: float | None = None):
    """Store 3 passages, then request them reordered; the first layer read kills the shard
    (and Redis when given), or with ``freeze`` SIGSTOPs them (SIGCONT once the request is
    answered). ``load_timeout_s``: the engine's load deadline for the reordered request (None:
    the engine's own, 2 s). Returns (output, load event, fallbacks counted, prompt ids, the
    reading client's counters)."""
    import ray
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from cluster.cache.client import CacheClient
    from cluster.cache.lifecycle import get_shard

    worker = get_kv_transfer_group()
    namespace = worker.namespace_digest
    writer = CacheClient(config, namespace=namespace)
    use_client(llm, writer, monkeypatch)
    texts = [passage(seed + i, num_sentences=8) for i in range(3)]
    cold_ids, _ = build_blend_prompt(tokenizer, SYSTEM, texts, "Question: warm?")
    cold = generate(llm, cold_ids)
    assert wait_stored(stats_path, cold.request_id)["stored"] == 3
    assert writer.flush(60)  # the shard's write-through to Redis included

    reader = CacheClient(config, namespace=namespace)  # nothing mapped: reads go to the shard
    use_client(llm, reader, monkeypatch)
    if load_timeout_s is not None:
        monkeypatch.setattr(worker.connector_worker._engine_for_worker(), "load_timeout_s", load_timeout_s)
    handle = get_shard(shard, config.cluster.ray_namespace)
    old_pid = ray.get(handle.ready.remote())["pid"]
    real_fetch = reader._fetch  # noqa: SLF001 - the one per-layer read both fetch paths use
    killed: list[int] = []
    frozen = contextlib.ExitStack()  # SIGCONT on close

    def kill_then_fetch(keys, layer_idx):
        if not killed:
            killed.append(layer_idx)
            if freeze:
                for pid in [old_pid] + ([redis.proc.pid] if redis is not None else []):
                    frozen.enter_context(sigstopped(pid))
            else:
                ray.kill(handle, no_restart=False)
                # ray.kill only asks: wait until the process is gone, or this read can still
                # reach the old shard (the test then saw no shard error, run alone)
                wait_gone(old_pid)
                if redis is not None:
                    redis.kill()
        return real_fetch(keys, layer_idx)

    monkeypatch.setattr(reader, "_fetch", kill_then_fetch)
    ids, _ = build_blend_prompt(tokenizer, SYSTEM, [texts[2], texts[0], texts[1]],
                                f"Question: which item is {seed * 10 + 1}? Answer:")
    fallbacks = worker.counters["fallbacks"]
    try:
        out = generate(llm, ids, {"kvblend_store": False})
        if freeze:
            # the engine gave up at its load deadline (2 s); the client's own call deadline (3 s)
            # ends its wait on the frozen process later: wait for that count (a hang guard)
            deadline = time.monotonic() + 60
            while reader.counters["timeouts"] < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        frozen.close()
        if redis is not None and not freeze:
            redis.restart()
        monkeypatch.undo()
        counters = dict(reader.counters)
        reader.close()
        writer.close()
    assert killed, "the load never read the cache"
    (load,) = events(stats_path, out.request_id, "load")
    if freeze:  # the same process answers again once it runs
        assert ray.get(handle.ready.remote(), timeout=60)["pid"] == old_pid
    else:
        wait_restarted(config, shard, old_pid)
    return out, load, worker.counters["fallbacks"] - fallbacks, ids, counters


def test_shard_killed_during_a_load_reads_redis(blend_llm, blend_stats_path, tokenizer, ray_redis_cache,
                                                monkeypatch):
    """The owner shard dies as the load starts: the client reads the chunks from the shared
    Redis tier and the request is still blended (no fallback), equal to full prefill; the
    client counted the dead shard and read Redis itself.

    The kill (``ray.kill``, then waiting for the process to exit) runs inside the first layer's
    read, and the call to the restarting shard may wait out the client's call deadline (3 s):
    on a loaded 2-core machine that passed the engine's 2 s load deadline and the request fell
    back (CI of stop 52). What is checked here is the client's path to Redis, not the engine's
    deadline (the frozen-shard tests below check that), so the engine waits up to 60 s."""
    config, shard = ray_redis_cache
    out, load, fallbacks, ids, counters = _blend_with_faults(blend_llm, blend_stats_path, tokenizer, config,
                                                             shard, monkeypatch, 1500, load_timeout_s=60.0)
    # every segment hits: the system prompt and the three passages the cold request stored (the
    # engine is reset for each test, so nothing an earlier test stored or scheduled counts)
    assert load["num_hit_segments"] == load["num_segments"] == 4, load
    assert not load["fallback"] and fallbacks == 0, load
    assert counters["shard_errors"] + counters["timeouts"] >= 1 and counters["direct_reads"] >= 1, counters
    assert_matches_full(out, generate(blend_llm, ids, FULL))


def test_shard_killed_and_redis_down_during_a_load_falls_back(blend_llm, blend_stats_path, tokenizer,
                                                              ray_redis_cache, redis_server,
                                                              monkeypatch):
    """Shard and Redis both gone during the load: the request is answered by full prefill,
    the fallback is counted, and the output equals full prefill's."""
    config, shard = ray_redis_cache
    out, load, fallbacks, ids, counters = _blend_with_faults(blend_llm, blend_stats_path, tokenizer, config,
                                                             shard, monkeypatch, 1600, redis=redis_server)
    assert load["fallback"] and load["num_hit_segments"] == 0 and fallbacks == 1
    assert counters["shard_errors"] + counters["timeouts"] >= 1, counters
    assert "could not be read" in load["full_prefill_reason"]
    assert_matches_full(out, generate(blend_llm, ids, FULL))


def test_shard_frozen_during_a_load_falls_back_by_the_deadline(blend_llm, blend_stats_path, tokenizer,
                                                              ray_redis_cache, monkeypatch):
    """The owner shard is SIGSTOPped as the load starts (it never answers and never dies;
    LMCache PR #5047's fault): the client's call deadline (3 s here) ends its wait, later than
    the engine's load deadline (``load_timeout_s`` 2 s), so the request falls back to full
    prefill — counted, with full prefill's output — instead of waiting for the shard."""
    config, shard = ray_redis_cache
    out, load, fallbacks, ids, counters = _blend_with_faults(blend_llm, blend_stats_path, tokenizer, config,
                                                             shard, monkeypatch, 1700, freeze=True)
    assert load["fallback"] and fallbacks == 1, load
    assert "could not be read" in load["full_prefill_reason"]
    assert counters["timeouts"] >= 1, counters
    assert_matches_full(out, generate(blend_llm, ids, FULL))


def test_shard_and_redis_frozen_during_a_load_fall_back(blend_llm, blend_stats_path, tokenizer,
                                                        ray_redis_cache, redis_server, monkeypatch):
    """Shard and redis-server both SIGSTOPped during the load: nothing answers, so the load's
    deadline makes the request fall back to full prefill (counted), with full prefill's output;
    neither process is restarted and both serve again after SIGCONT."""
    config, shard = ray_redis_cache
    out, load, fallbacks, ids, counters = _blend_with_faults(blend_llm, blend_stats_path, tokenizer, config,
                                                             shard, monkeypatch, 1800, redis=redis_server,
                                                             freeze=True)
    assert load["fallback"] and fallbacks == 1, load
    assert "could not be read" in load["full_prefill_reason"]
    assert counters["timeouts"] >= 1, counters
    assert_matches_full(out, generate(blend_llm, ids, FULL))
