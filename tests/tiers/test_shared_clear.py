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


# -- --stale: only objects of an older chunk format version -----------------------------------
def _version(obj: bytes, version: int) -> bytes:
    """``obj`` with the prefix's version field set to ``version`` (1: what the previous chunk
    format wrote; FORMAT_VERSION + 1: what an upgraded deployment writes)."""
    import struct

    return obj[:4] + struct.pack("<H", version) + obj[6:]


def _fill_mixed(tier):
    """Two current objects, two of version 1; returns ``(current keys, stale keys)``."""
    kv = make_kv()
    current = [make_key(300 + i, namespace=NS_A) for i in range(2)]
    stale = [make_key(400 + i, namespace=NS_A) for i in range(2)]
    for k in current:
        assert tier.put(k, make_object(k, kv))
    for k in stale:
        assert tier.put(k, _version(make_object(k, kv), 1))
    return current, stale


@pytest.mark.parametrize("kind", ["redis", "s3", "disk"])
def test_clear_stale_deletes_only_older_versions_and_keeps_current_chunks(kind, private_redis, s3_endpoint, tmp_path):
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
    assert clear(stale=True) == 2
    assert tier.contains(current) == [True, True] and tier.contains(stale) == [False] * 2
    assert clear(stale=True) == 0
    assert clear() == 2  # without --stale: every chunk object of ours


def _plant_others(kind, tier, raw):
    """Under ``tier``'s prefix, at keys that parse as chunk keys: a newer-format chunk object (an
    upgraded deployment sharing the store) and two foreign values (one shorter than a chunk
    prefix, one that merely has a chunk-like key); returns ``{key: value}``."""
    from tiers.keys import FORMAT_VERSION

    newer, short, foreign = (make_key(600 + i, namespace=NS_A) for i in range(3))
    values = {newer: _version(make_object(newer, make_kv()), FORMAT_VERSION + 1),
              short: b"KVBC", foreign: b"a value of someone else's, 32 bytes or more......"}
    for k, v in values.items():
        if kind == "redis":
            raw.set(f"{tier.key_prefix}{k}", v)
        else:
            raw.put_object(Bucket=tier.bucket, Key=f"{tier.prefix}{k}", Body=v)
    return values


def _stored(kind, tier, raw, key):
    if kind == "redis":
        return raw.get(f"{tier.key_prefix}{key}")
    return raw.get_object(Bucket=tier.bucket, Key=f"{tier.prefix}{key}")["Body"].read()


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_clear_and_clear_stale_keep_newer_formats_and_foreign_values(kind, private_redis, s3_endpoint):
    """#37: ``clear --stale`` deleted newer-format objects and any value under a chunk-like key;
    plain ``clear --shared`` deleted foreign values without reading them."""
    if kind == "redis":
        server = private_redis()
        tier, raw = RedisTier(server.url), redis.Redis.from_url(server.url)
        raw.hset(f"{tier.key_prefix}{make_key(700, namespace=NS_A)}", "f", "v")  # not a string
    else:
        endpoint, bucket = s3_endpoint
        tier = S3Tier(f"s3://{bucket}/own{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region="us-east-1")
        raw = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        raw.put_object(Bucket=bucket, Key=f"{tier.prefix}{make_key(700, namespace=NS_A)}", Body=b"")
    current, stale = _fill_mixed(tier)
    others = _plant_others(kind, tier, raw)

    got = tier.clear(stale=True)
    assert got == 2 and got.skipped == {"current": 2, "newer": 1, "foreign": 3}
    assert "kept 2 current object(s), 3 foreign value(s), 1 newer-format object(s)" in got.describe_skipped()
    got = tier.clear(NS_A)
    assert got == 2 and got.skipped == {"newer": 1, "foreign": 3}
    assert tier.contains(current + stale) == [False] * 4
    for k, v in others.items():
        assert _stored(kind, tier, raw, k) == v
    assert tier.clear() == 0
    tier.close()


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_clear_stale_after_a_key_rotation_reclaims_the_old_keys_objects(kind, private_redis, s3_endpoint):
    """#37: after the object key is rotated, objects signed under the old key (and unsigned
    ones) are never read again; ``clear --stale`` under the new key deletes them and keeps the
    new key's objects (it read only the 16-byte prefix before, and kept them all)."""
    from tiers import auth

    old, new = auth.ObjectAuth(b"o" * 32), auth.ObjectAuth(b"n" * 32)
    if kind == "redis":
        tier = RedisTier(private_redis().url)
    else:
        endpoint, bucket = s3_endpoint
        tier = S3Tier(f"s3://{bucket}/rot{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region="us-east-1")
    kv = make_kv()
    keys = {name: [make_key(base + i, namespace=NS_A) for i in range(2)]
            for name, base in (("old", 800), ("new", 810), ("unsigned", 820))}
    for name, signer in (("old", old), ("new", new), ("unsigned", None)):
        with auth.using(signer):
            for k in keys[name]:
                assert tier.put(k, make_object(k, kv))
    with auth.using(new):
        got = tier.clear(stale=True)
        assert got == 4 and got.skipped == {"current": 2}
        assert tier.contains(keys["new"]) == [True, True]
        assert tier.contains(keys["old"] + keys["unsigned"]) == [False] * 4
        assert tier.clear(stale=True) == 0
    with auth.using(None):  # without a key nothing can be told apart: only older formats go
        assert tier.clear(stale=True) == 0 and tier.contains(keys["new"]) == [True, True]
    tier.close()
