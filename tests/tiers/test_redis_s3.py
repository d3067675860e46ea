"""Redis and S3 specifics: dead servers and errors are misses, size limits, TTL, multipart."""

from __future__ import annotations

import botocore.exceptions
import pytest

from tests.factories import as_layer, layer_buffers, make_key, make_kv, make_object
from tiers.reader import ReadCounters, read_layers
from tiers.redis_tier import RedisTier
from tiers.s3 import S3Tier, parse_s3_url

pytestmark = pytest.mark.cluster


def test_redis_killed_mid_test_gives_misses_then_recovers(private_redis):
    server = private_redis()
    tier = RedisTier(server.url, timeout_s=0.5)
    key = make_key(1)
    kv = make_kv()
    assert tier.put(key, make_object(key, kv))
    server.kill()
    counters = ReadCounters()
    assert read_layers(tier, key, [0], layer_buffers(kv)[:1], counters=counters) is None
    assert counters.snapshot()["misses"] == 1
    assert tier.contains([key, make_key(2)]) == [False, False]
    assert tier.get(key) is None and tier.get_ranges(key, [(0, 4)]) is None
    assert not tier.put(make_key(3), make_object(make_key(3), kv))
    assert tier.delete([key]) == 0
    assert tier.stats()["errors"] >= 6
    server.restart()                                  # empty again (no persistence)
    assert tier.put(key, make_object(key, kv))
    outs = layer_buffers(kv)
    assert read_layers(tier, key, range(3), outs) is not None
    assert as_layer(outs[2], kv[2]).equal(kv[2])


def test_redis_value_over_proto_max_bulk_len_is_refused_clearly(caplog, private_redis):
    url = private_redis("--proto-max-bulk-len", "1mb").url
    tier = RedisTier(url)
    key = make_key(1)
    big = make_object(key, make_kv(num_tokens=1024, num_kv_heads=4, head_dim=64, num_layers=3))
    assert len(big) > 1 << 20
    assert not tier.put(key, big)
    assert tier.stats()["too_large"] == 1
    assert "proto-max-bulk-len" in caplog.text
    small = make_object(make_key(2), make_kv())
    assert tier.put(make_key(2), small)


def test_redis_ttl_and_pipelined_contains(redis_url):
    tier = RedisTier(redis_url, ttl_s=100, key_prefix="ttl-test:")
    keys = [make_key(i) for i in range(5)]
    for k in keys[::2]:
        tier.put(k, make_object(k, make_kv()))
    assert tier.contains(keys) == [True, False, True, False, True]
    assert 0 < tier._client.ttl(tier._rkey(keys[0])) <= 100
    assert tier.delete(keys) == 3


def test_redis_bad_arguments():
    with pytest.raises(ValueError):
        RedisTier("http://nope")
    with pytest.raises(ValueError):
        RedisTier("redis://127.0.0.1:1/0", ttl_s=-1)


def test_s3_url_parsing():
    assert parse_s3_url("s3://b") == ("b", "")
    assert parse_s3_url("s3://b/p/q/") == ("b", "p/q/")
    with pytest.raises(ValueError):
        parse_s3_url("https://b/p")
    with pytest.raises(ValueError):
        parse_s3_url("s3:///p")


def test_s3_dead_endpoint_gives_misses(unused_port):
    tier = S3Tier("s3://nobucket/x", endpoint_url=f"http://127.0.0.1:{unused_port}",
                  region="us-east-1", timeout_s=0.3, max_attempts=2)
    key = make_key(1)
    kv = make_kv()
    assert not tier.put(key, make_object(key, kv))
    assert tier.contains([key, make_key(2)]) == [False, False]
    assert read_layers(tier, key, [0], layer_buffers(kv)[:1]) is None
    assert tier.get(key) is None
    assert tier.stats()["errors"] >= 4
    tier.close()


def test_s3_throttling_and_errors_are_misses(make_tier, monkeypatch):
    tier = make_tier("s3")
    key = make_key(1)
    kv = make_kv()
    assert tier.put(key, make_object(key, kv))

    def throttled(**kwargs):  # fault injection: what boto3 raises after its retries
        raise botocore.exceptions.ClientError(
            {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "GetObject")

    monkeypatch.setattr(tier._client, "get_object", throttled)
    counters = ReadCounters()
    assert read_layers(tier, key, [0], layer_buffers(kv)[:1], counters=counters) is None
    assert counters.snapshot()["misses"] == 1 and tier.stats()["errors"] == 1
    monkeypatch.setattr(tier._client, "get_object", lambda **kw: (_ for _ in ()).throw(
        botocore.exceptions.ReadTimeoutError(endpoint_url="x")))
    assert tier.get(key) is None and tier.stats()["errors"] == 2
    monkeypatch.undo()
    assert read_layers(tier, key, [0], layer_buffers(kv)[:1]) is not None


def test_s3_multipart_put_round_trip(make_tier):
    tier = make_tier("s3", multipart_threshold_bytes=5 << 20)
    key = make_key(1)
    kv = make_kv(num_layers=2, num_tokens=1024, num_kv_heads=4, head_dim=352)   # ~11.5 MB
    obj = make_object(key, kv)
    assert len(obj) > 10 << 20
    assert tier.put(key, obj)
    assert tier.put(key, make_object(key, kv * 2))       # first wins on the multipart path too
    outs = layer_buffers(kv)
    assert read_layers(tier, key, [0, 1], outs) is not None
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    assert bytes(tier.get(key)) == obj


def test_redis_password_from_url_and_never_logged(caplog, private_redis):
    import logging

    caplog.set_level(logging.DEBUG)
    server = private_redis("--requirepass", "s3cret-pw")
    url = server.url.replace("redis://", "redis://:s3cret-pw@")
    tier = RedisTier(url)
    key = make_key(1)
    assert tier.put(key, make_object(key, make_kv()))
    assert tier.contains([key]) == [True]
    wrong = RedisTier(server.url.replace("redis://", "redis://:wrong@"))
    assert wrong.contains([key]) == [False] and not wrong.put(key, b"x")
    assert wrong.stats()["errors"] == 2
    assert "s3cret-pw" not in caplog.text and "wrong@" not in caplog.text


@pytest.mark.parametrize("checksums", ["default", "when_required"])
def test_s3_checksum_settings_neither_break_nor_pollute_a_32_mib_chunk(make_tier, monkeypatch, checksums):
    """boto3 #4435 (issue 20): botocore's default request checksums (aws-chunked bodies with a
    trailing CRC) and the ``when_required`` setting both put and get a 32 MiB chunk through an
    S3-compatible server (moto) byte-identical; the stored object is exactly the chunk (no
    checksum trailer in it)."""
    import boto3

    if checksums == "when_required":
        monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    else:
        monkeypatch.delenv("AWS_REQUEST_CHECKSUM_CALCULATION", raising=False)
        monkeypatch.delenv("AWS_RESPONSE_CHECKSUM_VALIDATION", raising=False)
    tier = make_tier("s3")
    key = make_key(32)
    kv = make_kv(num_layers=2, num_tokens=4096, num_kv_heads=4, head_dim=256)  # bfloat16
    obj = make_object(key, kv)
    assert len(obj) > 32 << 20
    assert tier.put(key, obj)
    assert bytes(tier.get(key)) == obj
    outs = layer_buffers(kv)
    assert read_layers(tier, key, [0, 1], outs) is not None
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    s3 = boto3.client("s3", endpoint_url=tier._client.meta.endpoint_url, region_name="us-east-1")
    listed = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=tier.bucket, Prefix=tier.prefix)
              for o in page.get("Contents", [])]
    assert [o["Size"] for o in listed] == [len(obj)]


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_bounded_get_refuses_a_longer_object_before_reading_it(kind, make_tier):
    """Issue 31 item 6: the agent's whole-object read of a chunk whose owner died is bounded by
    the size its header gives; a longer (planted) value is a miss counted in ``oversized``."""
    tier = make_tier(kind)
    key, small, big = make_key(31), make_object(make_key(31), make_kv()), make_object(make_key(32), make_kv(num_tokens=64))
    assert tier.put(key, small) and tier.put(make_key(32), big)
    assert tier.get(key, max_bytes=len(small)) == small
    assert tier.get(make_key(32), max_bytes=len(small)) is None
    assert tier.get(make_key(33), max_bytes=len(small)) is None  # missing: a plain miss
    assert tier.stats()["oversized"] == 1
    assert tier.get(make_key(32)) == big  # unbounded, as before
    with pytest.raises(ValueError):
        tier.get(key, max_bytes=0)
