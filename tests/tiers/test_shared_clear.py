"""``RedisTier.clear`` / ``S3Tier.clear`` (behind ``kvblend clear --shared``): only our chunk
keys of the namespace (or all namespaces) go; anything else in the server or bucket stays."""

from __future__ import annotations

import uuid

import boto3
import pytest
import redis

from tests.factories import make_key, make_kv, make_object
from tiers.redis_tier import RedisTier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.cluster

NS_A = "0123456789abcdef"
NS_B = "fedcba9876543210"


def _fill(tier, n_a: int, n_b: int):
    kv = make_kv()
    a = [make_key(100 + i, namespace=NS_A) for i in range(n_a)]
    b = [make_key(200 + i, namespace=NS_B) for i in range(n_b)]
    for k in a + b:
        assert tier.put(k, make_object(k, kv))
    return a, b


def test_redis_clear_namespace_then_all_in_batches_keeps_other_keys(private_redis):
    server = private_redis()
    # glob characters in the prefix must be literal: "kv[1]*:" must not match "kv1x:"
    tier = RedisTier(server.url, key_prefix="kv[1]*:")
    neighbour = RedisTier(server.url, key_prefix="kv1x:")
    a, b = _fill(tier, 5, 3)
    n_a, _ = _fill(neighbour, 2, 0)
    raw = redis.Redis.from_url(server.url)
    raw.set("unrelated", b"x")
    raw.set(f"kv[1]*:{NS_A}/not-a-chunk", b"x")  # under our prefix but no chunk key
    raw.set(f"kv[1]*:{NS_A}", b"x")

    assert tier.clear(NS_A, batch=2) == 5
    assert tier.contains(a) == [False] * 5
    assert tier.contains(b) == [True] * 3
    assert neighbour.contains(n_a) == [True, True]
    assert raw.get("unrelated") == b"x"
    assert raw.exists(f"kv[1]*:{NS_A}/not-a-chunk", f"kv[1]*:{NS_A}") == 2

    assert tier.clear(batch=2) == 3
    assert tier.contains(b) == [False] * 3
    assert neighbour.contains(n_a) == [True, True]
    assert raw.dbsize() == 5  # 2 neighbour chunks + 3 unrelated keys
    assert tier.clear() == 0


def test_redis_clear_errors(private_redis):
    server = private_redis()
    tier = RedisTier(server.url, timeout_s=0.5)
    with pytest.raises(ValueError):
        tier.clear("*")
    with pytest.raises(ValueError):
        tier.clear(NS_A, batch=0)
    server.kill()
    with pytest.raises(OSError, match="redis clear failed after deleting 0"):
        tier.clear(NS_A)
    assert tier.stats()["errors"] == 1


def test_s3_clear_paginates_and_keeps_other_objects(s3_endpoint):
    endpoint, bucket = s3_endpoint
    prefix = f"clr{uuid.uuid4().hex[:8]}"
    tier = S3Tier(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, region="us-east-1")
    a, b = _fill(tier, 7, 3)
    raw = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    others = [f"{prefix}x/{NS_A}/seg/abc",            # a neighbouring prefix
              f"other/{prefix}/{NS_A}/seg/abc",
              f"{prefix}/{NS_A}/README",              # under the prefix, not a chunk key
              f"{prefix}/{NS_A}"]
    for k in others:
        raw.put_object(Bucket=bucket, Key=k, Body=b"x")

    assert tier.clear(NS_A, batch=3) == 7             # 3 pages, 3 DeleteObjects
    assert tier.contains(a) == [False] * 7
    assert tier.contains(b) == [True] * 3
    assert tier.clear(batch=2) == 3
    assert tier.contains(b) == [False] * 3
    for k in others:
        assert raw.get_object(Bucket=bucket, Key=k)["Body"].read() == b"x"
    assert tier.clear() == 0
    with pytest.raises(ValueError):
        tier.clear(NS_A, batch=1001)
    with pytest.raises(ValueError):
        tier.clear("a/b")
    tier.close()


def test_s3_clear_of_a_missing_bucket_raises(s3_endpoint):
    endpoint, _ = s3_endpoint
    tier = S3Tier(f"s3://nobucket-{uuid.uuid4().hex[:6]}/p", endpoint_url=endpoint,
                  region="us-east-1", max_attempts=1)
    with pytest.raises(OSError, match="s3 clear failed after deleting 0"):
        tier.clear()
    assert tier.stats()["errors"] == 1
    tier.close()


def test_shared_tiers_do_not_list_keys():
    """Shards clear tiers that list keys (``TierStack.clear``); Redis and S3 must not be among
    them, or every shard would clear them on a plain ``kvblend clear``."""
    assert not hasattr(RedisTier, "keys") and not hasattr(S3Tier, "keys")


# -- --stale: only objects of another chunk format version (or no chunk object at all) --------
def _version_1(obj: bytes) -> bytes:
    """``obj`` as the previous chunk format wrote it: the prefix's version field is 1."""
    import struct

    return obj[:4] + struct.pack("<H", 1) + obj[6:]


def _fill_mixed(tier):
    """Two current objects, two of version 1, one that is no chunk object; returns
    ``(current keys, stale keys)``."""
    kv = make_kv()
    current = [make_key(300 + i, namespace=NS_A) for i in range(2)]
    stale = [make_key(400 + i, namespace=NS_A) for i in range(3)]
    for k in current:
        assert tier.put(k, make_object(k, kv))
    for k in stale[:2]:
        assert tier.put(k, _version_1(make_object(k, kv)))
    assert tier.put(stale[2], b"not a chunk object at all")
    return current, stale


@pytest.mark.parametrize("kind", ["redis", "s3", "disk"])
def test_clear_stale_deletes_only_other_versions_and_keeps_current_chunks(kind, private_redis, s3_endpoint, tmp_path):
    from tiers.disk import DiskTier
    from tiers.host import HostTier
    from tiers.stack import TierStack

    if kind == "redis":
        tier = RedisTier(private_redis().url)
        clear = tier.clear
    elif kind == "s3":
        endpoint, bucket = s3_endpoint
        tier = S3Tier(f"s3://{bucket}/stale{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region="us-east-1")
        clear = tier.clear
    else:  # a shard's stack: host memory above its disk directory
        tier = DiskTier(str(tmp_path), 1 << 20, fsync=False)
        clear = TierStack([HostTier(1 << 20), tier], write_down=()).clear
    current, stale = _fill_mixed(tier)
    assert clear(stale=True) == 3
    assert tier.contains(current) == [True, True] and tier.contains(stale) == [False] * 3
    assert clear(stale=True) == 0
    assert clear() == 2  # without --stale: everything
