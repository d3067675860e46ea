"""Issue 37 item 1: object authentication is on by default. On a fresh machine (no key)
``kvblend server`` creates the key (:func:`cluster.cli.object_key.prepare`); every kvblend
process there then loads it at start-up (``load_config``), so a chunk object planted in the
shared Redis or S3 prefix with valid checksums but no MAC — accepted by today's keyless
processes — is a counted miss. The key is a private file (``$KVBLEND_OBJECT_KEY_FILE`` under the
test's tmp path), never the machine's."""

from __future__ import annotations

import uuid

import pytest

from tests.factories import layer_buffers, make_key, make_kv, make_object, object_keys
from tiers import auth
from tiers.reader import ReadCounters, read_layers
from tiers.redis_tier import RedisTier
from tiers.s3 import S3Tier

pytestmark = pytest.mark.cluster


@pytest.fixture
def shared_tiers(redis_url, s3_endpoint):
    """A Redis and an S3 tier over the suite's servers, each under a prefix of its own."""
    endpoint, bucket = s3_endpoint
    redis = RedisTier(redis_url, key_prefix=f"k37{uuid.uuid4().hex[:8]}:", timeout_s=2.0)
    s3 = S3Tier(f"s3://{bucket}/k37{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region="us-east-1",
                timeout_s=5.0, max_attempts=2)
    yield {"redis": redis, "s3": s3}
    redis.close()
    close = getattr(s3, "close", None)
    if close is not None:
        close()


def test_a_planted_unsigned_object_is_a_miss_on_a_fresh_server_machine(shared_tiers, tmp_path, monkeypatch):
    from cluster.cli import object_key
    from cluster.config import load_config

    key_file = tmp_path / "object-key"
    monkeypatch.delenv("KVBLEND_OBJECT_KEY", raising=False)
    key, kv = make_key(3700), make_kv(3700)
    with object_keys() as use_key:
        use_key(None)
        planted = make_object(key, kv)  # what anyone who can write Redis or the bucket can make
        for tier in shared_tiers.values():
            assert tier.put(key, planted)
        load_config()  # a process of this machine before `kvblend server` ran: no key, it would hit
        assert auth.current() is None
        assert read_layers(shared_tiers["redis"], key, range(kv.shape[0]), layer_buffers(kv)) is not None

        monkeypatch.setenv("KVBLEND_OBJECT_KEY_FILE", str(key_file))  # this machine's place for it
        where = object_key.prepare(no_object_auth=False)  # `kvblend server` on the fresh machine
        assert where == str(key_file) and key_file.is_file()
        use_key(None)
        load_config()  # any kvblend process of the machine starting now finds the key
        assert auth.current() is not None
        for name, tier in shared_tiers.items():
            counters = ReadCounters()
            assert read_layers(tier, key, range(kv.shape[0]), layer_buffers(kv), counters=counters) is None, name
            assert counters.snapshot()["corrupt"] == 1 and counters.snapshot()["hits"] == 0, name
        # what the keyed process stores itself is signed, and hits
        signed_key = make_key(3701)
        for name, tier in shared_tiers.items():
            assert tier.put(signed_key, make_object(signed_key, kv)), name
            assert read_layers(tier, signed_key, range(kv.shape[0]), layer_buffers(kv)) is not None, name
