"""Bounded puts (issue #20): the client's unsettled puts and the shard's write-downs stop at
their bound, drop the newest and count it, and never make the caller wait — without Ray.

The client's bound is one for every transport: a stand-in transport whose puts settle only when
the test says so. ``ShardWriter`` (the Ray transport's sends) gets a stand-in router whose
shard's ``put.remote`` returns a ref that settles when the test says so (its ``future()`` a
real ``concurrent.futures.Future``; ``ray.wait`` patched to read those refs). ``CacheShard`` is
built in-process as in ``test_shard_prefetched.py``, with a lower stack whose writes block.
The only timing is a hang guard: each call must return within 10 s.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cluster.cache import puts as puts_mod
from tests.factories import HANG_S, make_key, make_kv, ray_free_shard, returns_within, stop_shard
from tiers import write_behind
from tiers.codec import encode_kv
from tiers.config import TiersConfig
from tiers.keys import ChunkKey

pytestmark = pytest.mark.unit


# -- the client's bound ---------------------------------------------------------------------------
class _HeldPuts:
    """A transport whose puts settle only when :meth:`settle` says so."""

    name, counters, remote, compress, up, keep_bytes, threaded = "held", (), False, False, True, 0, False

    def __init__(self) -> None:
        self.sent: list = []  # (request, done)

    def bind(self, host) -> None:
        pass

    def put(self, request, done) -> bool:
        self.sent.append((request, done))
        return True

    def settle(self, n: int) -> None:
        for _request, done in self.sent[:n]:
            done(True)

    def close(self) -> None:
        pass


def _kv(i: int, num_tokens: int = 4) -> torch.Tensor:
    return make_kv(i, dtype=torch.float32)[:, :, :num_tokens]


def test_client_keeps_at_most_n_puts_unsettled_and_drops_the_newest(monkeypatch):
    from cluster.cache.client import CacheClient

    cap = 4
    monkeypatch.setattr(puts_mod, "MAX_PENDING_PUTS", cap)
    transport = _HeldPuts()
    client = CacheClient(None, transports=[transport])
    keys = [make_key(i) for i in range(3 * cap)]
    for i, k in enumerate(keys):  # nothing settles
        returns_within(client.put, k, _kv(i))
    assert [r.key for r, _ in transport.sent] == keys[:cap]  # the oldest were sent
    assert client.counters["puts"] == cap and client.counters["puts_dropped"] == 2 * cap
    transport.settle(2)  # two settle: two new puts fit again
    for i, k in enumerate(keys[cap:cap + 3]):
        returns_within(client.put, k, _kv(cap + i))
    assert len(transport.sent) == cap + 2 and client.counters["puts_dropped"] == 2 * cap + 1
    client.close()


def test_client_bounds_unsettled_bytes_and_drops_before_encoding(monkeypatch):
    from cluster.cache import client as client_mod

    transport = _HeldPuts()
    client = client_mod.CacheClient(None, transports=[transport])
    size = len(encode_kv(make_key(0), _kv(0)))
    monkeypatch.setattr(puts_mod, "MAX_PENDING_PUT_BYTES", int(2.5 * size))
    for i in range(5):
        returns_within(client.put, make_key(i), _kv(i))
    assert len(transport.sent) == 2 and client.counters["puts_dropped"] == 3  # a third would pass the bound
    monkeypatch.setattr(client_mod, "encode_kv", lambda *a, **k: pytest.fail("encoded past the bound"))
    client.put(make_key(9), _kv(9))
    assert client.counters["puts_dropped"] == 4
    monkeypatch.undo()
    transport.settle(2)
    big = make_key(99)
    returns_within(client.put, big, make_kv(99, dtype=torch.float32))  # alone, over the bound: still sent
    assert transport.sent[-1][0].key == big
    client.close()


class _Ref:
    """A put call's ref: its future settles (True) when the test releases it."""

    def __init__(self, key_text: str) -> None:
        self.key_text = key_text
        self.fut: Future = Future()

    def future(self) -> Future:
        return self.fut

    def settle(self, stored: bool = True) -> None:
        self.fut.set_result(stored)


class _Shard:
    """A shard handle whose put calls never settle by themselves."""

    def __init__(self) -> None:
        self.refs: list[_Ref] = []
        self.put = SimpleNamespace(remote=self._put)
        self.drain = SimpleNamespace(remote=lambda timeout_s: True)  # no lower tiers behind these puts

    def _put(self, key_text, arr):
        self.refs.append(_Ref(key_text))
        return self.refs[-1]


class _Router:
    def __init__(self, shard: _Shard) -> None:
        self.shard = shard

    def groups(self, keys):
        return {"shard-0": list(keys)}

    def usable(self, name):
        return True

    def handle(self, name):
        return self.shard


def test_writer_settles_each_put_once_counts_refusals_and_flush_waits_for_every_one(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (
        [r for r in refs if r.fut.done()], [r for r in refs if not r.fut.done()]))
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)  # drain answers True
    shard, counts, settled = _Shard(), Counter(), []
    writer = puts_mod.ShardWriter(_Router(shard), lambda name, n: counts.update({name: n}))
    keys = [make_key(i) for i in range(3)]
    for k in keys:
        assert returns_within(writer.send, k, b"x" * 16, settled.append) is True
    assert not returns_within(writer.send, keys[0], b"x" * 16, settled.append)  # in flight: not twice
    assert all(writer.in_flight(k) for k in keys) and settled == []
    assert returns_within(writer.flush, 0.0) is False  # unsettled puts: not flushed
    shard.refs[0].settle(True)
    shard.refs[1].settle(False)  # the shard refused it
    assert settled == [True, False] and counts["put_errors"] == 1 and not writer.in_flight(keys[0])
    shard.refs[2].settle(True)
    assert returns_within(writer.flush, 5.0) is True and not any(writer.in_flight(k) for k in keys)


# -- CacheShard write-down ----------------------------------------------------------------------------
class _BlockingLower:
    """A lower stack whose writes block until released (``put`` or ``store``: either path)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list = []
        self._lock = threading.Lock()

    def _write(self, key):
        assert self.release.wait(HANG_S * 3)
        with self._lock:
            self.written.append(key)
        return True

    def put(self, key, obj, header=None):
        return self._write(key)

    def store(self, key, obj, names, *, header=None):
        self._write(key)
        return {}

    def flush(self, timeout_s=None):
        return True

    def contains(self, keys):
        with self._lock:
            return [k in self.written for k in keys]

    def delete(self, keys):
        return 0


@pytest.fixture
def shard(monkeypatch, tmp_path):
    s = ray_free_shard(monkeypatch, tmp_path, TiersConfig(host_size_gib=0.01, disk_size_gib=0.0))
    s.lower_stack = _BlockingLower()
    yield s
    s.lower_stack.release.set()
    stop_shard(s)


def _obj(i: int) -> tuple[str, np.ndarray]:
    key = make_key(i)
    raw = encode_kv(key, make_kv(i, dtype=torch.float32), None, compress=False)
    return str(key), np.frombuffer(raw, dtype=np.uint8)


def test_shard_put_returns_while_lower_tiers_block_and_drops_write_downs_past_the_bound(
        shard, monkeypatch):
    cap = 4
    monkeypatch.setattr(write_behind, "MAX_PENDING_WRITES", cap, raising=False)
    objs = [_obj(i) for i in range(3 * cap)]
    for text, arr in objs:  # every lower-tier write blocks
        assert returns_within(shard.put, text, arr) is True  # host memory took each of them
    assert shard.counters["puts"] == 3 * cap
    assert shard.counters.get("writes_dropped") == 2 * cap
    assert len(shard.writes) == cap
    assert shard.stats()["counters"]["writes_dropped"] == 2 * cap

    shard.lower_stack.release.set()  # drain waits for the write-downs it accepted: the oldest
    assert returns_within(shard.drain, HANG_S) is True
    assert sorted(map(str, shard.lower_stack.written)) == sorted(t for t, _ in objs[:cap])
    assert len(shard.writes) == 0
    assert returns_within(shard.put, *_obj(100)) is True  # room again: written down
    assert returns_within(shard.drain, HANG_S) is True
    assert str(shard.lower_stack.written[-1]) == str(make_key(100))
    assert shard.counters["writes_dropped"] == 2 * cap


def test_shard_bounds_write_down_bytes(shard, monkeypatch):
    objs = [_obj(i) for i in range(6)]
    size = objs[0][1].nbytes
    monkeypatch.setattr(write_behind, "MAX_PENDING_WRITE_BYTES", int(2.5 * size), raising=False)
    for text, arr in objs:
        assert returns_within(shard.put, text, arr) is True
    assert len(shard.writes) == 2
    assert shard.counters.get("writes_dropped") == 4


def test_a_put_neither_host_nor_write_down_took_is_refused(shard, monkeypatch):
    monkeypatch.setattr(write_behind, "MAX_PENDING_WRITES", 1, raising=False)
    shard._store_host = lambda key, obj, header_end: None  # host memory refuses everything
    assert returns_within(shard.put, *_obj(0)) is True   # its write-down was queued
    assert returns_within(shard.put, *_obj(1)) is False  # stored nowhere: the client counts put_errors


def test_a_chunk_evicted_from_host_memory_before_its_write_down_landed_is_still_read(
        monkeypatch, tmp_path):
    """The demo's flake (a hit at lookup, missing at read: the request recomputed): host memory
    evicts a chunk whose write-down is still pending, so it is in no tier. The pending write
    holds it: lookup and get_refs find it, and it goes back into host memory."""
    objs = [_obj(i) for i in range(8)]
    host_gib = 4 * objs[0][1].nbytes / 2**30  # room for four of them
    shard = ray_free_shard(monkeypatch, tmp_path, TiersConfig(host_size_gib=host_gib, disk_size_gib=0.0))
    shard.lower_stack = _BlockingLower()  # write-downs block: every one stays pending
    try:
        _read_while_the_write_down_is_pending(shard, objs)
    finally:
        shard.lower_stack.release.set()
        stop_shard(shard)


def _read_while_the_write_down_is_pending(shard, objs) -> None:
    for text, arr in objs:
        assert returns_within(shard.put, text, arr) is True
    first = ChunkKey.parse(objs[0][0])
    assert not shard.host.contains([first])[0], "the test needs the first chunk evicted"
    assert shard.writes.held(first) is not None
    hit = returns_within(shard.lookup, [objs[0][0]])[0]
    assert hit is not None and hit[0] == "host"
    assert returns_within(shard.get_refs, [objs[0][0]])[0] == [f"ref:{first}"]
    assert shard.counters["write_behind_hits"] == 1  # put back once; the get found it there
    assert shard.counters["misses"] == 0

    # deleted while its write-down waits for a thread (four run, blocked): it never lands
    last = ChunkKey.parse(objs[-1][0])
    shard.host.delete([last])  # evicted, as the first was
    assert returns_within(shard.contains, [objs[-1][0]]) == [True]
    assert returns_within(shard.delete, [objs[-1][0]]) == 1
    assert returns_within(shard.lookup, [objs[-1][0]]) == [None]

    shard.lower_stack.release.set()  # landed: no longer held
    assert returns_within(shard.drain, HANG_S) is True
    assert shard.writes.held(first) is None and len(shard.writes) == 0
    assert first in shard.lower_stack.written and last not in shard.lower_stack.written
