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
        stats = client.shard_stats()
        assert sum(s["counters"].get("read_errors", 0) for s in stats.values()) >= 1
        # the client's own direct Redis lookup (every shard presumed dead) refuses it as well
        reader = CacheClient(cfg, NAMESPACE)
        reader.router.suspect.update({name: math.inf for name in stats})
        assert reader.lookup([planted_key]) == [None]
        reader.close()
        use_key(None)  # control: a process without a key takes it from Redis
        reader = CacheClient(cfg, NAMESPACE)
        reader.router.suspect.update({name: math.inf for name in stats})
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
