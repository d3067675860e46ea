"""Whole-object reads from Redis and S3 are bounded before they allocate (#37): a planted value
far longer than the object its header describes is a miss counted in ``oversized``, and no
read path takes more than the bound into memory (tracemalloc's peak; nothing is timed)."""

from __future__ import annotations

import tracemalloc

import boto3
import pytest
import redis

from tests.factories import layer_buffers, make_key, make_kv, make_object
from tiers.host import HostTier
from tiers.reader import ReadCounters, read_layers
from tiers.stack import TierStack

pytestmark = pytest.mark.cluster

JUNK = 24 << 20  # bytes planted after a valid object
BOUND = 4 << 20  # what any read of it may allocate at most


def _plant(kind, tier, key, value: bytes, redis_url: str) -> None:
    """``value`` stored under ``key`` in ``tier``'s store by another client (no validation)."""
    if kind == "redis":
        redis.Redis.from_url(redis_url).set(f"{tier.key_prefix}{key}", value)
    else:
        s3 = boto3.client("s3", endpoint_url=tier._client.meta.endpoint_url, region_name="us-east-1")
        s3.put_object(Bucket=tier.bucket, Key=f"{tier.prefix}{key}", Body=value)


def _peak(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_planted_oversized_value_is_a_miss_without_reading_it(kind, make_tier, redis_url):
    tier = make_tier(kind)
    key, kv = make_key(1), make_kv()
    obj = make_object(key, kv)
    _plant(kind, tier, key, obj + b"\0" * JUNK, redis_url)  # a valid header, then far more than it describes

    stack = TierStack([HostTier(64 << 20), tier], write_down=())
    got, peak = _peak(lambda: stack.get(key))     # the shard's promotion read: whole objects
    assert got is None and peak < BOUND
    assert tier.stats()["oversized"] == 1 and tier.stats()["bytes_read"] < BOUND
    stack.close()

    tier.max_object_bytes = 1 << 20               # the tier's own cap (max_object_mib)
    got, peak = _peak(lambda: tier.get(key))
    assert got is None and peak < BOUND and tier.stats()["oversized"] == 2

    if kind == "s3":  # one streamed request for header and layers: longer than described
        counters = ReadCounters()
        got, peak = _peak(lambda: read_layers(tier, key, range(3), layer_buffers(kv), counters=counters))
        assert got is None and peak < BOUND and counters.values["corrupt"] == 1

    small = make_key(2)
    assert tier.put(small, make_object(small, kv))
    stack = TierStack([HostTier(64 << 20), tier], write_down=())
    assert stack.get(small) is not None           # an object of its own size reads whole
    stack.close()
