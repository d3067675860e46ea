"""Fixtures of the blend tests (factories live in ``tests/factories.py``)."""

from __future__ import annotations

import pytest

from blend.engine import BlendEngine
from cluster.cache.local import LocalCacheClient
from tests.factories import tiny_adapter
from tiers.tier import MemoryTier


@pytest.fixture
def make_setup():
    """``make_setup(model_type, ...) -> (engine, client)`` with an empty memory tier."""

    def make(model_type: str = "llama", **kw):
        adapter = tiny_adapter(model_type, **kw)
        client = LocalCacheClient(MemoryTier(1 << 28, name="host"))
        return BlendEngine(adapter, client), client

    return make
