"""``kvblend clear --shared`` against a real redis-server and a moto S3 server, with no Ray:
only our chunk objects of the namespace go; without ``--shared`` Redis and S3 are untouched."""

from __future__ import annotations

import uuid

import boto3
import pytest
import redis

from cluster.cli.main import main
from tests.factories import make_key, make_kv, make_object
from tiers.keys import FORMAT_VERSION
from tiers.redis_tier import RedisTier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.cluster

NS_A = "0123456789abcdef"
NS_B = "fedcba9876543210"


@pytest.fixture
def shared(tmp_path, private_redis, s3_endpoint, unused_port):
    """A config naming a fresh Redis and a fresh S3 prefix, both holding 3 chunks of NS_A, 2
    of NS_B and an unrelated key; returns a namespace of handles."""
    server = private_redis()
    endpoint, bucket = s3_endpoint
    s3_url = f"s3://{bucket}/cli{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "kvblend.yaml"
    cfg.write_text(f"redis_url: {server.url}\ns3_url: {s3_url}\ns3_endpoint_url: {endpoint}\n"
                   "s3_region: us-east-1\nio_timeout_s: 2\n")
    rt = RedisTier(server.url)
    st = S3Tier(s3_url, endpoint_url=endpoint, region="us-east-1")
    kv = make_kv()
    a = [make_key(300 + i, namespace=NS_A) for i in range(3)]
    b = [make_key(400 + i, namespace=NS_B) for i in range(2)]
    for tier in (rt, st):
        for k in a + b:
            assert tier.put(k, make_object(k, kv))
    raw_redis = redis.Redis.from_url(server.url)
    raw_redis.set("unrelated:key", b"keep")
    raw_s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    raw_s3.put_object(Bucket=bucket, Key=f"elsewhere/{NS_A}/seg/abc", Body=b"keep")
    # no Ray at this address: the command must not need shards for --shared
    argv = ["clear", "--config", str(cfg), "--address", f"127.0.0.1:{unused_port}",
            "--ray-namespace", f"kvblend-clear-{uuid.uuid4().hex[:6]}"]

    class Handles:
        pass

    h = Handles()
    h.__dict__.update(argv=argv, a=a, b=b, redis=rt, s3=st, raw_redis=raw_redis, raw_s3=raw_s3,
                      bucket=bucket, server=server)
    yield h
    rt.close()
    st.close()


def _unrelated_kept(h) -> None:
    assert h.raw_redis.get("unrelated:key") == b"keep"
    got = h.raw_s3.get_object(Bucket=h.bucket, Key=f"elsewhere/{NS_A}/seg/abc")
    assert got["Body"].read() == b"keep"


def test_clear_shared_deletes_the_namespace_from_redis_and_s3_without_shards(shared, capsys):
    h = shared
    assert main([*h.argv, "--namespace", NS_A, "--shared"]) == 0
    out = capsys.readouterr().out
    assert "no shards reachable" in out
    assert f"redis (key prefix 'kvblend:'): deleted 3 chunk object(s) of namespace {NS_A}" in out
    assert f"deleted 3 chunk object(s) of namespace {NS_A}" in out.split("s3 (", 1)[1]
    for tier in (h.redis, h.s3):
        assert tier.contains(h.a) == [False] * 3
        assert tier.contains(h.b) == [True] * 2
    _unrelated_kept(h)

    assert main([*h.argv, "--shared"]) == 0  # every namespace
    out = capsys.readouterr().out
    assert "redis (key prefix 'kvblend:'): deleted 2 chunk object(s)\n" in out
    for tier in (h.redis, h.s3):
        assert tier.contains(h.b) == [False] * 2
    _unrelated_kept(h)
    assert h.raw_redis.dbsize() == 1


def test_clear_stale_shared_deletes_only_objects_of_another_format_version(shared, capsys):
    import struct

    h = shared
    old = [make_key(500 + i, namespace=NS_A) for i in range(2)]  # what the previous format wrote
    newer = make_key(600, namespace=NS_A)  # an upgraded deployment's, sharing the tiers
    for tier in (h.redis, h.s3):
        for k in old:
            obj = make_object(k, make_kv())
            assert tier.put(k, obj[:4] + struct.pack("<H", 1) + obj[6:])
        obj = make_object(newer, make_kv())
        assert tier.put(newer, obj[:4] + struct.pack("<H", FORMAT_VERSION + 1) + obj[6:])
    assert main([*h.argv, "--stale", "--shared"]) == 0
    out = capsys.readouterr().out
    assert ("redis (key prefix 'kvblend:'): deleted 2 chunk object(s) of an older format version; "
            "kept 5 current object(s), 1 newer-format object(s)") in out
    assert "deleted 2 chunk object(s) of an older format version" in out.split("s3 (", 1)[1]
    for tier in (h.redis, h.s3):
        assert tier.contains(old) == [False] * 2
        assert tier.contains(h.a + h.b + [newer]) == [True] * 6  # every current chunk stays
    _unrelated_kept(h)


def test_clear_without_shared_leaves_redis_and_s3_alone(shared, capsys):
    h = shared
    assert main([*h.argv, "--namespace", NS_A]) == 1  # no shards: nothing was cleared
    captured = capsys.readouterr()
    assert "cannot reach Ray" in captured.err
    assert ("left the shared tiers (redis, s3) alone: run `kvblend clear --shared` to delete "
            "their chunks too") in captured.out
    for tier in (h.redis, h.s3):
        assert tier.contains(h.a + h.b) == [True] * 5
    _unrelated_kept(h)


def test_clear_shared_reports_a_dead_redis_and_still_clears_s3(shared, capsys):
    h = shared
    h.server.kill()
    assert main([*h.argv, "--namespace", NS_A, "--shared"]) == 1
    captured = capsys.readouterr()
    assert "redis clear failed after deleting 0 chunk object(s)" in captured.err
    assert f"deleted 3 chunk object(s) of namespace {NS_A}" in captured.out
    assert h.s3.contains(h.a) == [False] * 3 and h.s3.contains(h.b) == [True] * 2


def test_clear_help_documents_shared(capsys):
    with pytest.raises(SystemExit):
        main(["clear", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--shared" in out and "Redis" in out and "S3" in out
