"""Shards over a shared Redis tier: a dead owner is served from Redis (through the other shard
or by the client directly); Redis stopped -> those reads miss, everything else works."""

from __future__ import annotations

import math
import uuid

import pytest
import torch

from tests.factories import NAMESPACE, make_key, redis_shards, shard_kv

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def redis_setup(ray_cluster, tmp_path_factory):
    cluster, _ = ray_cluster
    with redis_shards(cluster.address, tmp_path_factory.mktemp("redis-shards")) as (cfg, names, redis):
        assert len(names) == 2
        yield cfg, names, redis


def test_chunk_re_encoded_below_memory_is_sliced_with_its_own_header(redis_setup):
    """A reader looks a chunk up while its owner holds it raw in host memory, then the host
    copy is evicted: the owner promotes Redis's lz4 copy, whose layer offsets and checksums
    differ from the header the lookup returned. The reader slices the object it maps with
    that object's own header (every layer bit-exact, no read error, no direct read). Seen
    through vLLM: a restarted shard's objects failed every layer's checksum."""
    from cluster.cache.client import CacheClient

    cfg, _, _ = redis_setup
    client = CacheClient(cfg, NAMESPACE)
    key = make_key(8000)
    g = torch.Generator().manual_seed(8000)  # small integers: lz4 shrinks every layer
    kv = torch.randint(0, 4, (4, 2, 256, 2, 8), generator=g).to(torch.bfloat16)
    client.put(key, kv)
    assert client.flush(60)
    reader = CacheClient(cfg, NAMESPACE)
    assert reader.lookup([key])[0].tier == "host"
    header = reader._meta[key].header
    assert all(e.codec == 0 for e in header.layers)

    owner = reader._meta[key].shard
    fillers = [k for k in (make_key(8100 + j) for j in range(400))
               if reader.transport.router.placement.owner(str(k)) == owner][:12]
    for i, k in enumerate(fillers):  # 12 x 512 KiB of random KV through a 4 MiB host tier
        client.put(k, shard_kv(8100 + i, num_tokens=2048))
    assert client.flush(60)
    assert CacheClient(cfg, NAMESPACE).lookup([key])[0].tier == "redis"  # and the owner promotes it

    got = [reader.fetch_layer([key], layer).result(60)[0] for layer in range(4)]
    assert all(g is not None and torch.equal(g, kv[i]) for i, g in enumerate(got))
    mapped_header = reader.objects.get(key)[1]
    assert any(e.codec == 1 for e in mapped_header.layers)  # the lz4 copy was mapped
    assert reader.counters["read_errors"] == 0 and reader.counters["direct_reads"] == 0
    reader.close()
    client.close()


def test_dead_owner_is_served_from_redis_and_redis_down_is_a_miss(redis_setup):
    from cluster.cache.client import CacheClient

    cfg, names, redis = redis_setup
    client = CacheClient(cfg, NAMESPACE)
    keys = [make_key(9000 + i) for i in range(10)]
    kvs = [shard_kv(9000 + i) for i in range(10)]
    for k, kv in zip(keys, kvs, strict=True):
        client.put(k, kv)
    assert client.flush(60)  # host + Redis written
    assert all(m is not None and m.tier == "host" for m in client.lookup(keys))

    # the owner of some keys stops answering: the client reads Redis itself
    dead = client._meta[keys[0]].shard
    dead_idx = [i for i, k in enumerate(keys) if client._meta[k].shard == dead]
    live_idx = [i for i in range(10) if i not in dead_idx]
    reader = CacheClient(cfg, NAMESPACE)
    reader.transport.router.suspect[dead] = math.inf
    metas = reader.lookup(keys)
    for i, m in enumerate(metas):
        assert m is not None
        assert m.tier == ("redis" if i in dead_idx else "host")
    got = reader.fetch_layer(keys, 2).result(60)
    assert all(torch.equal(g, kv[2]) for g, kv in zip(got, kvs, strict=True))
    assert reader.counters["direct_reads"] >= 2 * len(dead_idx)

    # Redis dies as well: the dead owner's keys miss, the live shard's keys still hit
    redis.kill()
    metas = reader.lookup(keys)
    assert [m is not None for m in metas] == [i in live_idx for i in range(10)]
    got = reader.fetch_layer(keys, 1).result(60)
    for i, g in enumerate(got):
        if i in live_idx:
            assert torch.equal(g, kvs[i][1])
    # puts keep working (host tier) while Redis is down
    new_key = next(k for k in (make_key(9100 + j) for j in range(50))
                   if reader.transport.router.placement.owner(str(k)) != dead)
    reader.put(new_key, shard_kv(1))
    reader.flush(30)  # the Redis write fails (counted on the shard); nothing raises
    assert reader.contains([new_key]) == [True]
    assert torch.equal(reader.fetch_layer([new_key], 0).result(30)[0], shard_kv(1)[0])
    # Redis comes back empty (no persistence): draining the live shard before removing its
    # node writes what it holds back into Redis, and the placement then finds it there
    redis.start()
    from cluster.cache.lifecycle import shard_node_id, stop_shards
    from tiers.redis_tier import RedisTier

    live = next(n for n in names if n != dead)
    stopped = stop_shards(cfg.cluster.ray_namespace, node=shard_node_id(live), drain=True)
    assert stopped == [live]
    held = [keys[i] for i in live_idx] + [new_key]
    assert RedisTier(redis.url).contains(held) == [True] * len(held)
    reader.close()
    client.close()


@pytest.fixture(scope="module")
def s3_setup(ray_cluster, tmp_path_factory):
    import contextlib
    import os

    from cluster.cache.lifecycle import start_shards, stop_shards
    from cluster.config import load_config
    from cluster.workloads.services import start_s3

    cluster, _ = ray_cluster
    stack = contextlib.ExitStack()
    endpoint, bucket = stack.enter_context(start_s3())
    creds = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    cfg = load_config(environ={}, overrides={
        "ray_address": cluster.address, "ray_namespace": f"kvblend-s3-{uuid.uuid4().hex[:6]}",
        "cache_dir": str(tmp_path_factory.mktemp("s3-shards")), "host_size_gib": 0.004,
        "disk_size_gib": 0.0, "s3_url": f"s3://{bucket}/kv", "s3_endpoint_url": endpoint,
        "io_timeout_s": 0.5, "call_timeout_s": 10.0, "load_timeout_s": 10.0, "metrics": False})
    try:
        names = start_shards(cfg, env_vars=creds)
        assert len(names) == 2
        yield cfg, stack, bucket, endpoint
    finally:
        stop_shards(cfg.cluster.ray_namespace)
        stack.close()


def test_dead_owner_is_served_from_s3_and_s3_down_is_a_miss(s3_setup):
    import boto3

    from cluster.cache.client import CacheClient

    cfg, stack, bucket, endpoint = s3_setup
    client = CacheClient(cfg, NAMESPACE)
    keys = [make_key(9500 + i) for i in range(8)]
    kvs = [shard_kv(9500 + i) for i in range(8)]
    for k, kv in zip(keys, kvs, strict=True):
        client.put(k, kv)
    assert client.flush(60)
    listed = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket, Prefix="kv/")
    assert {o["Key"] for o in listed.get("Contents", [])} == {f"kv/{k}" for k in keys}

    assert all(m is not None for m in client.lookup(keys))
    dead = client._meta[keys[0]].shard
    dead_idx = [i for i, k in enumerate(keys) if client._meta[k].shard == dead]
    reader = CacheClient(cfg, NAMESPACE)
    reader.transport.router.suspect[dead] = math.inf
    metas = reader.lookup(keys)
    assert [m.tier for m in metas] == ["s3" if i in dead_idx else "host" for i in range(8)]
    got = reader.fetch_layer(keys, 3).result(60)
    assert all(torch.equal(g, kv[3]) for g, kv in zip(got, kvs, strict=True))

    stack.close()  # the S3 endpoint goes away: after the tier's retries, those reads miss
    fresh = CacheClient(cfg, NAMESPACE)
    fresh.transport.router.suspect[dead] = math.inf
    metas = fresh.lookup(keys)
    assert [m is not None for m in metas] == [i not in dead_idx for i in range(8)]
    for c in (client, reader, fresh):
        c.close()
