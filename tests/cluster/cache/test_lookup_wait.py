"""The client waits for the shards' lookup answers ``lookup_timeout_s`` + a margin, not
``call_timeout_s`` (issue #20); a late shard is a miss for its keys and is not marked failed.

No Ray: ``CacheClient`` is built with its connection and writer replaced by stand-ins and a real
``ShardRouter`` over two stand-in shard handles, one answering at once, one whose answer does
not come for BLOCK_S (``ray.get`` patched to wait on the stand-in refs). The only timing is a
hang guard: the lookup must return within HANG_S while ``call_timeout_s`` is 30 s."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from cluster.cache import client as client_mod
from cluster.cache import ray_transport
from cluster.cache import router as router_mod
from tests.factories import make_key, make_kv, make_object, returns_within
from tiers.format import parse_header

pytestmark = pytest.mark.cluster

HANG_S = 5.0
BLOCK_S = 60.0
SHARDS = ("shard-fast", "shard-slow")


class _Ref:
    def __init__(self, value, ready: threading.Event) -> None:
        self.value, self.ready = value, ready


class _Handle:
    """A shard handle whose ``lookup.remote`` answers every key as a host hit, at once or (the
    slow shard) only when ``ready`` is set."""

    def __init__(self, headers: dict, slow: bool) -> None:
        self.ready = threading.Event()
        if not slow:
            self.ready.set()
        self.calls = 0
        self.lookup = SimpleNamespace(remote=self._lookup)

    def _lookup(self, keys, prefetch, with_refs, known):
        self.calls += 1
        return _Ref([("host", self.headers[k], None) for k in keys], self.ready)


@pytest.fixture
def setup(monkeypatch):
    import ray

    keys = [make_key(i) for i in range(8)]
    headers = {}
    for i, k in enumerate(keys):
        obj = make_object(k, make_kv(i))
        headers[str(k)] = obj[:parse_header(obj).header_end]
    handles = {name: _Handle(headers, slow=name == "shard-slow") for name in SHARDS}
    for h in handles.values():
        h.headers = headers

    def fake_get(ref, timeout=None):
        if not ref.ready.wait(timeout if timeout is not None else BLOCK_S):
            raise ray.exceptions.GetTimeoutError("late")
        return ref.value

    monkeypatch.setattr(ray, "get", fake_get)
    monkeypatch.setattr(router_mod, "shard_names", lambda ns: list(SHARDS))
    monkeypatch.setattr(router_mod, "get_shard", lambda name, ns: handles.get(name))
    monkeypatch.setattr(ray_transport, "connect", lambda cluster: object())
    monkeypatch.setattr(ray_transport, "ShardWriter", lambda router, count: None)
    cfg = SimpleNamespace(
        cluster=SimpleNamespace(call_timeout_s=30.0, ray_address="", ray_namespace="test"),
        tiers=SimpleNamespace(lookup_timeout_s=0.25, redis_url="", s3_url=""))
    client = client_mod.CacheClient(cfg)
    monkeypatch.setattr(client, "shared_tiers", lambda: [])
    yield client, handles, keys
    for h in handles.values():
        h.ready.set()
    client.close()


def _returns(fn, *args):
    return returns_within(fn, *args, hang_s=HANG_S, what=f"lookup waited > {HANG_S} s for a slow shard")


def test_a_slow_shard_is_a_miss_by_the_lookup_deadline_and_not_marked_failed(setup):
    client, handles, keys = setup
    owners = [client.transport.router.placement.owner(str(k)) for k in keys]
    assert set(owners) == set(SHARDS)  # both shards own some of the keys
    t0 = time.monotonic()
    got = _returns(client.lookup, keys)
    assert time.monotonic() - t0 < HANG_S
    for k, owner, meta in zip(keys, owners, got, strict=True):
        assert (meta is not None) == (owner == "shard-fast"), k
    assert client.counters["timeouts"] == 1
    # slow once is not failed: not suspect, its handle kept, asked again at the next lookup
    assert client.transport.router.usable("shard-slow")
    assert "shard-slow" in client.transport.router.handles
    _returns(client.lookup, keys)
    assert handles["shard-slow"].calls == 2


def test_router_without_late_still_marks_a_timed_out_shard_failed(setup):
    client, _, keys = setup
    router = client.transport.router
    groups = router.groups(keys)
    out = _returns(lambda: router.call(groups, "lookup", lambda idx: (
        [str(keys[i]) for i in idx], True, False, [False] * len(idx)), 0.2))
    assert set(out) == {"shard-fast"}
    assert not router.usable("shard-slow")
