"""Secrets out of logs and messages (issue 19): URL passwords masked by :mod:`tiers.redact`,
in the shared-tier warning a shard logs for a URL that does not open, in the tiers' own
errors and in the config's repr."""

from __future__ import annotations

import logging

import pytest

from tiers.config import TiersConfig
from tiers.lower import shared_tiers

pytestmark = pytest.mark.cluster

PW = "hunter2pw"
MASK = "***"


@pytest.mark.parametrize("url, shown", [
    (f"redis://:{PW}@redis:6379/0", "redis://:***@redis:6379/0"),
    (f"rediss://default:{PW}@redis.example:6380/2", "rediss://default:***@redis.example:6380/2"),
    (f"redis://{PW}@redis:6379/0", "redis://***@redis:6379/0"),
    ("redis://:p%40ss%2Fw@redis:6379/0", "redis://:***@redis:6379/0"),
    ("redis://:pa/ss@redis:6379/0", "redis://:***@redis:6379/0"),  # unescaped '/': still masked
    (f"http://user:{PW}@minio:9000", "http://user:***@minio:9000"),
    ("redis://redis:6379/0", "redis://redis:6379/0"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
    ("", ""),
])
def test_redact_url(url, shown):
    from tiers.redact import redact_url

    assert redact_url(url) == shown


def test_redact_url_leaves_non_strings():
    from tiers.redact import redact_url

    assert redact_url(None) is None and redact_url(3) == 3


def test_redact_text_masks_the_url_and_the_bare_password():
    from tiers.redact import redact_text

    url = "redis://:p%40ss@redis:6379/0"
    text = f"cannot open {url}: AUTH p@ss refused (p%40ss)"
    out = redact_text(text, url, "")
    assert "p@ss" not in out and "p%40ss" not in out
    assert "redis://:***@redis:6379/0" in out and out.count(MASK) == 3


def test_redact_fields_masks_url_fields_only():
    from tiers.redact import redact_fields

    out = redact_fields({"redis_url": f"redis://:{PW}@r:1/0", "s3_endpoint_url": f"http://a:{PW}@m",
                         "disk_path": "/data/x@y", "chunk_size": 256})
    assert PW not in repr(out)
    assert out["disk_path"] == "/data/x@y" and out["chunk_size"] == 256


def test_tiers_config_repr_masks_the_password():
    cfg = TiersConfig(redis_url=f"redis://:{PW}@redis:6379/0")
    assert PW not in repr(cfg) and "redis://:***@redis:6379/0" in repr(cfg)
    assert cfg.redis_url == f"redis://:{PW}@redis:6379/0"  # the value itself is untouched


@pytest.mark.parametrize("url", [
    f"redis://:{PW}@redis:notaport/0",  # does not parse (port)
    f"http://:{PW}@redis:6379/0",       # not a Redis scheme
])
def test_shared_tier_warning_masks_the_password(url, caplog):
    pytest.importorskip("redis")
    with caplog.at_level(logging.WARNING, logger="tiers.lower"):
        assert shared_tiers(TiersConfig(redis_url=url)) == []
    (record,) = [r for r in caplog.records if r.name == "tiers.lower"]
    message = record.getMessage()
    assert "redis tier" in message and "unavailable" in message
    assert PW not in message and MASK in message


def test_redis_tier_error_masks_the_password():
    pytest.importorskip("redis")
    from tiers.redis_tier import RedisTier

    with pytest.raises(ValueError, match="malformed") as err:
        RedisTier(f"redis://:{PW}@redis:notaport/0")
    assert PW not in str(err.value)
