"""The client's header cache is bounded by an estimate of its bytes, not by a count (issue #20).

No Ray: ``CacheClient`` is built over a ``RayTransport`` whose connection, router and writer are
stand-ins; ``_remember``, the header cache and the held objects are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cluster.cache import client as client_mod
from cluster.cache.headers import HeaderEntry
from tests.factories import make_key, ray_free_client
from tiers.format import ChunkHeader, LayerEntry

pytestmark = pytest.mark.unit


@pytest.fixture
def client(monkeypatch):
    cfg = SimpleNamespace(cluster=SimpleNamespace(call_timeout_s=1.0, ray_address="",
                                                  ray_namespace="test"), tiers=None)
    c = ray_free_client(monkeypatch, cfg)
    yield c
    c.close()


def _entry(key, num_layers: int, num_tokens: int, runs: int = 1):
    layer = LayerEntry(offset=0, stored_len=1, raw_len=1, codec=0, checksum=0)
    step = num_tokens // runs
    positions = tuple((2 * i * step, step) for i in range(runs))
    header = ChunkHeader(key=str(key), dtype="bfloat16", num_layers=num_layers,
                         num_tokens=num_tokens, num_kv_heads=1, head_dim=1, positions=positions,
                         layers=(layer,) * num_layers, header_end=64)
    return HeaderEntry(header, "shard-0", "host")


def test_big_headers_are_bounded_by_bytes_and_take_their_mappings_along(client):
    # 400 headers of 1024 layers and 4096 tokens: far under the old count cap (65536), but
    # ~0.45 MB each by the estimate (the entry keeps their 4096 positions too)
    keys = [make_key(i) for i in range(400)]
    for k in keys:
        client.objects[k] = (np.zeros(1, np.uint8), None, True)
        client._remember(k, _entry(k, 1024, 4096))
    kept = list(client._meta)
    assert 0 < len(kept) < len(keys)
    assert kept == keys[-len(kept):]  # the newest stay, the oldest went first
    assert list(client.objects) == kept  # an evicted header's object went with it

    from cluster.cache.headers import entry_nbytes

    total = sum(entry_nbytes(e) for e in client._meta.values())
    assert client._meta.nbytes == total <= client_mod.MAX_CACHED_HEADER_BYTES
    assert total + entry_nbytes(_entry(keys[0], 1024, 4096)) > client_mod.MAX_CACHED_HEADER_BYTES


def test_small_headers_are_all_kept_and_a_lookup_refreshes_recency(client):
    keys = [make_key(i) for i in range(2000)]
    for k in keys:
        client._remember(k, _entry(k, 2, 4))
    assert list(client._meta) == keys
    client._remember(keys[0], _entry(keys[0], 2, 4))  # looked up again: now the newest
    assert list(client._meta)[-1] == keys[0] and len(client._meta) == len(keys)


def test_header_cache_keeps_its_byte_count_through_every_removal():
    from cluster.cache.headers import HeaderCache, entry_nbytes

    cache = HeaderCache()
    keys = [make_key(i) for i in range(6)]

    def check():
        assert cache.nbytes == sum(entry_nbytes(e) for e in cache.values())

    for i, k in enumerate(keys):
        cache[k] = _entry(k, 4 + i, 16, runs=1 + i % 3)
        check()
    cache[keys[0]] = _entry(keys[0], 64, 256)  # replaced under the same key
    check()
    assert cache.pop(keys[1]).header.num_layers == 5
    check()
    assert cache.pop(keys[1], None) is None
    with pytest.raises(KeyError):
        cache.pop(keys[1])
    del cache[keys[2]]
    check()
    assert cache.popitem(last=False)[0] == keys[0]
    assert cache.popitem()[0] == keys[5]
    check()
    small = entry_nbytes(cache[keys[4]])
    assert cache.trim(small) == [keys[3]]  # oldest first, until within the budget
    assert list(cache) == [keys[4]]
    check()
    cache.clear()
    assert cache.nbytes == 0 and not cache
    assert cache.trim(0) == []
