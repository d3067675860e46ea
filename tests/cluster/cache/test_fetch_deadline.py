"""A worker-side read has one deadline (issue #20): ``CacheClient.fetch_layer`` no longer
spends ``call_timeout_s`` per object when the Ray transport's batched ``ray.get`` fails, nor
``io_timeout_s`` per key reading shared tiers directly, one after another.

No Ray cluster and no sleeping: ``CacheClient`` is built over a ``RayTransport`` with stand-ins
for its connection, router and writer (as in ``test_client_headers.py``), and the modules'
clock is a fake that each stand-in read advances by what the real call would have waited."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.cache import layer_reads, ray_transport
from cluster.cache.headers import HeaderEntry
from cluster.cache.ops import ObjectsRequest
from tests.factories import make_key, ray_free_client
from tiers.format import ChunkHeader, LayerEntry

pytestmark = pytest.mark.unit


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(layer_reads, "time", c)  # the read deadline
    monkeypatch.setattr(ray_transport, "time", c)
    return c


def _config():
    return SimpleNamespace(cluster=SimpleNamespace(call_timeout_s=1.0, ray_address="", ray_namespace="test"),
                           blend=SimpleNamespace(load_timeout_s=2.0), tiers=None)


@pytest.fixture
def client(monkeypatch, clock):
    c = ray_free_client(monkeypatch, _config())
    yield c
    c.close()


def _entry(key, shard: str = "") -> HeaderEntry:
    layer = LayerEntry(offset=0, stored_len=1, raw_len=1, codec=0, checksum=0)
    header = ChunkHeader(key=str(key), dtype="bfloat16", num_layers=2, num_tokens=4, num_kv_heads=1,
                         head_dim=1, positions=((0, 4),), layers=(layer,) * 2, header_end=64)
    return HeaderEntry(header, shard, "redis")


def test_direct_reads_stop_at_the_fetch_deadline(client, clock, monkeypatch):
    """Eight keys only a shared tier holds, each direct read taking 0.6 s (an ``io_timeout_s``
    near its limit): reads start until ``max(call_timeout_s, load_timeout_s)`` = 2 s have
    passed, the other keys are misses counted as ``timeouts``; before, all eight were read
    (4.8 s on one of the client's four threads)."""
    keys = [make_key(i) for i in range(8)]
    started = []

    def direct(key, header, layer_idx):
        started.append(key)
        clock.now += 0.6
        return f"layer of {key}"

    monkeypatch.setattr(client, "map_for_read", lambda ks: ([_entry(k) for k in ks], [None] * len(ks)))
    monkeypatch.setattr(client, "shared_tiers", lambda: ["redis"])
    monkeypatch.setattr(client, "_direct_layer", direct)
    t0 = clock.now
    got = client._fetch(keys, 1)
    assert len(started) == 4  # at 0, 0.6, 1.2 and 1.8 s; the fifth would start at 2.4 s
    assert got[:4] == [f"layer of {k}" for k in keys[:4]] and got[4:] == [None] * 4
    assert client.counters["timeouts"] == 4 and client.counters["layer_misses"] == 4
    assert clock.now - t0 <= 2.0 + 0.6  # the last read started before the deadline


def test_one_by_one_object_gets_share_the_call_deadline(monkeypatch, clock):
    """The batched ``ray.get`` of five objects times out (``call_timeout_s`` = 1 s); the
    one-by-one retry then gets what is left of the same second (0 s: only objects already
    local), not a second each: before, 1 + 5 x 1 s."""
    import ray

    waits = []

    def fake_get(refs, timeout=None):
        waits.append(timeout)
        clock.now += timeout
        raise ray.exceptions.GetTimeoutError("stand-in: no object")

    class OneShard:  # the shard answers get_refs with a ref per key
        def groups(self, keys):
            return {"shard-0": list(range(len(keys)))}

        def call(self, groups, method, args_for, timeout_s=None, late=None):
            assert method == "get_refs"
            return {"shard-0": [[object()] for _ in groups["shard-0"]]}

        def refresh(self, force=False):
            pass

    monkeypatch.setattr(ray, "get", fake_get)
    client = ray_free_client(monkeypatch, _config(), router=OneShard())
    try:
        keys = tuple(make_key(10 + i) for i in range(5))
        t0 = clock.now
        got = client.transport.objects(ObjectsRequest(keys, timeout_s=2.0))
        assert waits[0] == 1.0 and waits[1:] == [0.0] * 5
        assert clock.now - t0 == 1.0
        assert got.objects == (None,) * 5 and client.counters["shard_errors"] == 5
    finally:
        client.close()


def test_the_fetch_timeout_is_the_longer_of_call_and_load_timeouts(client, monkeypatch):
    assert client.fetch_timeout_s == 2.0
    no_blend = SimpleNamespace(cluster=client.config.cluster, tiers=None)  # no blend section
    other = ray_free_client(monkeypatch, no_blend)
    try:
        assert other.fetch_timeout_s == 1.0
    finally:
        other.close()
