"""Fixtures of the tiers tests (factories live in ``tests/factories.py``; the service fixtures
of ``tests/services.py``, e.g. ``redis_url``, reach every test through ``tests/conftest.py``)."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def make_tier(tmp_path, request):
    """``make_tier(kind, **kwargs)`` -> a fresh, empty byte tier of that kind."""
    made = []

    def factory(kind: str, capacity_bytes: int = 1 << 24, **kwargs):
        if kind == "host":
            from tiers.host import HostTier
            tier = HostTier(capacity_bytes, **kwargs)
        elif kind == "disk":
            from tiers.disk import DiskTier
            tier = DiskTier(str(tmp_path / f"disk-{uuid.uuid4().hex[:6]}"), capacity_bytes,
                            fsync=False, **kwargs)
        elif kind == "redis":
            from tiers.redis_tier import RedisTier
            tier = RedisTier(request.getfixturevalue("redis_url"), key_prefix=f"t{uuid.uuid4().hex[:8]}:", timeout_s=2.0, **kwargs)
        elif kind == "s3":
            from tiers.s3 import S3Tier
            endpoint, bucket = request.getfixturevalue("s3_endpoint")
            tier = S3Tier(f"s3://{bucket}/t{uuid.uuid4().hex[:8]}", endpoint_url=endpoint,
                          region="us-east-1", timeout_s=5.0, max_attempts=2, **kwargs)
        else:
            raise ValueError(kind)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        close = getattr(tier, "close", None)
        if close is not None:
            close()
