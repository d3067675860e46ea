"""The scheduler and worker halves of the connector run the same over every transport of the one
cache client (issue 32): the in-process engine (``blend_llm``, ratio 1.0) gets a client over the
shard actors from this process (``ray``), over a cache agent process (``agent``, the connector's
default) or over a tier in this process (``local``); a cold request stores three passages
through it, and the same passages reordered are blended from it — every segment a hit, no
fallback — with the output of full prefill."""

from __future__ import annotations

import pytest

from blend.segments import build_blend_prompt
from tests.cluster.vllm.helpers import (
    FULL,
    SYSTEM,
    assert_matches_full,
    events,
    generate,
    one_node_ray_cache,
    passage,
    use_client,
    wait_stored,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def ray_cache(tmp_path_factory):
    """A config of a one-node Ray cluster with one shard (host memory and disk)."""
    from cluster.config import load_config

    with one_node_ray_cache(tmp_path_factory.mktemp("transports")) as (overrides, _names):
        yield load_config(environ={}, overrides=overrides)


def _client(kind: str, config, namespace: str):
    from cluster.cache.client import CacheClient
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient

    if kind == "ray":
        return CacheClient(config, namespace)
    if kind == "agent":
        client = agent_client(config, namespace, LocalCacheClient())
        assert client.transports[0].up, "the agent serves the shards"
        return client
    return LocalCacheClient()


@pytest.mark.parametrize("kind", ["ray", "agent", "local"])
def test_ratio_one_through_each_transport_is_full_prefill(kind, blend_llm, blend_stats_path, tokenizer,
                                                          ray_cache, monkeypatch):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    seed = {"ray": 3100, "agent": 3200, "local": 3300}[kind]
    client = _client(kind, ray_cache, get_kv_transfer_group().namespace_digest)
    try:
        use_client(blend_llm, client, monkeypatch)
        texts = [passage(seed + i, num_sentences=8) for i in range(3)]
        cold_ids, _ = build_blend_prompt(tokenizer, SYSTEM, texts, "Question: warm?")
        cold = generate(blend_llm, cold_ids)
        assert wait_stored(blend_stats_path, cold.request_id)["stored"] == 3  # the worker half's puts
        assert client.flush(60)
        ids, _ = build_blend_prompt(tokenizer, SYSTEM, [texts[2], texts[0], texts[1]],
                                    f"Question: which item is {seed + 1}? Answer:")
        before = dict(client.counters)
        out = generate(blend_llm, ids, {"kvblend_store": False})
        (load,) = events(blend_stats_path, out.request_id, "load")
        counters = dict(client.counters)
    finally:
        monkeypatch.undo()
        client.close()
    assert load["num_hit_segments"] == load["num_segments"] == 4 and not load["fallback"], load
    assert counters["lookups"] > before["lookups"], "the scheduler half looked the segments up here"
    assert counters["layer_reads"] > before["layer_reads"] and counters["layer_misses"] == before["layer_misses"]
    assert_matches_full(out, generate(blend_llm, ids, FULL))
