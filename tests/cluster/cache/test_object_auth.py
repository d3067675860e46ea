"""Object authentication through the running cache (issue #19 item 5): Ray shards and a
client share an object key (``KVBLEND_OBJECT_KEY``; shards get it as the chart gives it to
every pod). A chunk object planted in the shared Redis under a real key, with valid checksums
but no MAC (what anyone who can write Redis could do), is a miss for the shard's lookup and
for the client's direct read; the same chunk put through the cache is a bit-exact hit."""

from __future__ import annotations

import math

import pytest
import torch

from tests.factories import (
    NAMESPACE,
    OBJECT_KEY_A,
    make_key,
    make_object,
    object_keys,
    redis_shards,
    shard_kv,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def signed_setup(ray_cluster, tmp_path_factory):
    cluster, _ = ray_cluster
    with redis_shards(cluster.address, tmp_path_factory.mktemp("signed-shards"),
                      env_vars={"KVBLEND_OBJECT_KEY": OBJECT_KEY_A}, metrics=False) as (cfg, names, redis):
        assert len(names) == 2
        yield cfg, redis


def test_a_planted_redis_object_without_a_mac_is_a_miss_and_a_signed_one_hits(signed_setup):
    with object_keys() as use_key:
        _planted_then_signed(*signed_setup, use_key)


def _planted_then_signed(cfg, redis, use_key) -> None:
    from cluster.cache.client import CacheClient
    from tiers.redis_tier import RedisTier

    planted_key, kv = make_key(9700), shard_kv(9700)
    use_key(None)
    planted = make_object(planted_key, kv, compress=True)  # valid checksums, no MAC
    assert RedisTier(redis.url).put(planted_key, planted)

    use_key(OBJECT_KEY_A)  # this process is a kvblend worker too
    client = CacheClient(cfg, NAMESPACE)
    try:
        assert client.lookup([planted_key]) == [None]  # the owner shard refused it
        stats = client.stats()["shards"]
        assert sum(s["counters"].get("read_errors", 0) for s in stats.values()) >= 1
        # the client's own direct Redis lookup (every shard presumed dead) refuses it as well
        reader = CacheClient(cfg, NAMESPACE)
        reader.transport.router.suspect.update({name: math.inf for name in stats})
        assert reader.lookup([planted_key]) == [None]
        reader.close()
        use_key(None)  # control: a process without a key takes it from Redis
        reader = CacheClient(cfg, NAMESPACE)
        reader.transport.router.suspect.update({name: math.inf for name in stats})
        assert reader.lookup([planted_key])[0].tier == "redis"
        reader.close()
        use_key(OBJECT_KEY_A)

        signed_key = make_key(9701)
        client.put(signed_key, kv)
        assert client.flush(60)
        assert client.lookup([signed_key])[0] is not None
        assert all(torch.equal(client.fetch_layer([signed_key], i).result(60)[0], kv[i]) for i in range(4))
        stored = RedisTier(redis.url).get(signed_key)  # what the shard wrote down is signed
        assert stored is not None and stored[6] & 1
    finally:
        client.close()


def forge_layer(obj: bytes) -> bytes:
    """``obj`` (signed under the key in force) with layer 0's payload changed and its XXH3
    made to match, the header re-signed: header tag and checksums valid, layer 0's tag not.
    What a closed-form XXH3 collision under a genuine header gives an attacker who can write
    Redis (re-signing here stands in for the collision; the attacker needs no key)."""
    import struct

    import xxhash

    from tiers import auth
    from tiers.format import PREFIX_BYTES, parse_header, rewrite_header

    header = parse_header(obj)
    e0 = header.layers[0]
    payload = bytearray(obj[e0.offset:e0.offset + e0.stored_len])
    payload[:8] = bytes(b ^ 0x5A for b in payload[:8])
    layers = [[e.offset, e.stored_len, e.raw_len, e.codec, e.checksum, e.tag.hex()] for e in header.layers]
    layers[0][4] = xxhash.xxh3_64_intdigest(bytes(payload))
    out = bytearray(rewrite_header(obj, layers=layers))  # offsets consistent, header tag stale
    (header_len,) = struct.unpack_from("<I", out, 8)
    end = PREFIX_BYTES + header_len
    blob = bytes(out[PREFIX_BYTES:end - auth.TAG_BYTES])
    tag = auth.current().header_tag(bytes(out[:12]), blob)
    out[end - auth.TAG_BYTES:end] = tag
    struct.pack_into("<I", out, 12, xxhash.xxh32_intdigest(blob + tag))
    e0 = parse_header(out).layers[0]
    out[e0.offset:e0.offset + e0.stored_len] = payload
    return bytes(out)


def _forgery_is_what_it_claims(forged: bytes) -> None:
    from tiers.format import AuthError, check_payload, parse_header

    header = parse_header(forged)  # header tag valid
    e0 = header.layers[0]
    check_payload(header, 0, forged[e0.offset:e0.offset + e0.stored_len], authenticate=False)  # XXH3 valid
    with pytest.raises(AuthError):
        check_payload(header, 0, forged[e0.offset:e0.offset + e0.stored_len])


@pytest.fixture
def agent_over_signed_shards(ray_cluster, tmp_path):
    """Signed shards over a Redis of their own (killed by the test), and the connector's
    default client on them: ``(config, redis process, the agent-chain client)``."""
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient

    cluster, _ = ray_cluster
    with object_keys() as use_key, redis_shards(cluster.address, tmp_path, metrics=False,
                                                env_vars={"KVBLEND_OBJECT_KEY": OBJECT_KEY_A}) as (cfg, _, redis):
        use_key(OBJECT_KEY_A)
        import os

        os.environ["KVBLEND_OBJECT_KEY"] = OBJECT_KEY_A  # the agent's key: it inherits ours
        client = agent_client(cfg, NAMESPACE, LocalCacheClient())
        try:
            yield cfg, redis, client
        finally:
            client.close()


def test_a_forged_redis_object_is_a_miss_through_the_agent_while_its_owner_is_dead(agent_over_signed_shards):
    """Issue 31 item 2: the owner shard is dead, Redis holds a forged copy (valid header tag
    and XXH3, wrong KV under layer 0's stale tag). Before, the agent forwarded it unchecked and
    vLLM's process checked XXH3 only: the forged layer reached the engine as KV."""
    import ray

    from cluster.cache.client import CacheClient
    from tiers.redis_tier import RedisTier

    cfg, redis, client = agent_over_signed_shards
    assert client.transports[0].up
    key, kv = make_key(9800), shard_kv(9800)
    writer = CacheClient(cfg, NAMESPACE)
    try:
        writer.put(key, kv)
        assert writer.flush(60)
        tier = RedisTier(redis.url)
        stored = tier.get(key)
        assert stored is not None and stored[6] & 1  # what the shard wrote down is signed
        forged = forge_layer(stored)
        _forgery_is_what_it_claims(forged)
        tier._client.set(tier._rkey(key), forged)
        (owner,) = writer.transport.router.groups([key])
        ray.kill(writer.transport.router.handle(owner), no_restart=True)
    finally:
        writer.close()
    assert client.lookup([key])[0] is not None  # the header, read from Redis, is genuine
    layers = [client.fetch_layer([key], i).result(60)[0] for i in range(kv.shape[0])]
    assert layers == [None] * kv.shape[0], "a forged layer reached the engine"
    assert client.counters["layer_misses"] == kv.shape[0]
    assert client.counters["read_errors"] >= 1  # the forged copy, read from Redis by this process
