"""Bounded puts (issue #20): the client's pending puts and the shard's write-downs stop at
their bound, drop the newest and count it, and never make the caller wait — without Ray.

``ShardWriter`` gets a stand-in router whose shard's ``put.remote`` returns a ref that does not
settle until the test says so (``ray.wait``/``ray.get`` patched to read those refs).
``CacheShard`` is built in-process as in ``test_shard_prefetched.py``, with a lower stack whose
writes block. The only timing is a hang guard: each call must return within 10 s.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cluster.cache import puts as puts_mod
from cluster.cache import shard as shard_mod
from tests.factories import HANG_S, make_key, make_kv, ray_free_shard, returns_within, stop_shard
from tiers.codec import encode_kv
from tiers.config import TiersConfig

pytestmark = pytest.mark.unit


# -- ShardWriter ----------------------------------------------------------------------------------
class _Ref:
    """A put call's ref: settles (True) when the test releases it."""

    def __init__(self, key_text: str) -> None:
        self.key_text = key_text
        self.settled = threading.Event()


class _Shard:
    """A shard handle whose put calls never settle by themselves."""

    def __init__(self) -> None:
        self.refs: list[_Ref] = []
        self.put = SimpleNamespace(remote=self._put)
        self.drain = SimpleNamespace(remote=self._drain)

    def _drain(self, timeout_s):  # no writes to lower tiers behind these puts: answers at once
        ref = _Ref("drain")
        ref.settled.set()
        return ref

    def _put(self, key_text, arr):
        ref = _Ref(key_text)
        self.refs.append(ref)
        return ref


class _Router:
    def __init__(self, shard: _Shard) -> None:
        self.shard = shard

    def groups(self, keys):
        return {"shard-0": list(keys)}

    def usable(self, name):
        return True

    def handle(self, name):
        return self.shard


@pytest.fixture
def writer(monkeypatch):
    import ray

    def wait(refs, num_returns=1, timeout=None):
        done = [r for r in refs if r.settled.is_set()]
        return done, [r for r in refs if not r.settled.is_set()]

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref.settled.is_set())
    shard = _Shard()
    counts: Counter = Counter()
    w = puts_mod.ShardWriter(_Router(shard), lambda name, n: counts.update({name: n}))
    return w, shard, counts


def test_writer_keeps_at_most_n_puts_pending_and_drops_the_newest(writer, monkeypatch):
    w, shard, counts = writer
    cap = 4
    monkeypatch.setattr(puts_mod, "MAX_PENDING_PUTS", cap)
    keys = [make_key(i) for i in range(3 * cap)]
    for k in keys:  # the shard answers none of them
        returns_within(w.send, k, b"x" * 16)
    assert [r.key_text for r in shard.refs] == [str(k) for k in keys[:cap]]  # the oldest were sent
    assert counts["puts"] == cap
    assert counts["puts_dropped"] == 2 * cap and w.puts_dropped == 2 * cap
    assert counts["put_errors"] == 0
    assert all(w.in_flight(k) for k in keys[:cap]) and not any(w.in_flight(k) for k in keys[cap:])

    for r in shard.refs[:2]:  # two settle: two new puts fit again (settled without waiting)
        r.settled.set()
    for k in keys[cap:cap + 3]:
        returns_within(w.send, k, b"x" * 16)
    assert len(shard.refs) == cap + 2
    assert counts["puts_dropped"] == 2 * cap + 1

    for r in shard.refs:  # flush still waits for every put that was sent (drain: none)
        r.settled.set()
    assert returns_within(w.flush, 5.0) is True
    assert not any(w.in_flight(k) for k in keys)


def test_writer_bounds_pending_bytes(writer, monkeypatch):
    w, shard, counts = writer
    # raising=False: the code before the bound has no such constant (and no bound)
    monkeypatch.setattr(puts_mod, "MAX_PENDING_PUT_BYTES", 1000, raising=False)
    for i in range(5):
        returns_within(w.send, make_key(i), b"x" * 400)
    assert len(shard.refs) == 2  # 800 bytes pending; a third 400 would pass 1000
    assert counts["puts_dropped"] == 3
    big = make_key(99)
    for r in shard.refs:
        r.settled.set()
    returns_within(w.send, big, b"x" * 5000)  # alone, an object over the bound is still sent
    assert shard.refs[-1].key_text == str(big)


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
    monkeypatch.setattr(shard_mod, "MAX_PENDING_WRITES", cap, raising=False)
    objs = [_obj(i) for i in range(3 * cap)]
    for text, arr in objs:  # every lower-tier write blocks
        assert returns_within(shard.put, text, arr) is True  # host memory took each of them
    assert shard.counters["puts"] == 3 * cap
    assert shard.counters.get("writes_dropped") == 2 * cap
    assert len(shard._writes) == cap
    assert shard.stats()["counters"]["writes_dropped"] == 2 * cap

    shard.lower_stack.release.set()  # drain waits for the write-downs it accepted: the oldest
    assert returns_within(shard.drain, HANG_S) is True
    assert sorted(map(str, shard.lower_stack.written)) == sorted(t for t, _ in objs[:cap])
    assert len(shard._writes) == 0
    assert returns_within(shard.put, *_obj(100)) is True  # room again: written down
    assert returns_within(shard.drain, HANG_S) is True
    assert str(shard.lower_stack.written[-1]) == str(make_key(100))
    assert shard.counters["writes_dropped"] == 2 * cap


def test_shard_bounds_write_down_bytes(shard, monkeypatch):
    objs = [_obj(i) for i in range(6)]
    size = objs[0][1].nbytes
    monkeypatch.setattr(shard_mod, "MAX_PENDING_WRITE_BYTES", int(2.5 * size), raising=False)
    for text, arr in objs:
        assert returns_within(shard.put, text, arr) is True
    assert len(shard._writes) == 2
    assert shard.counters.get("writes_dropped") == 4


def test_a_put_neither_host_nor_write_down_took_is_refused(shard, monkeypatch):
    monkeypatch.setattr(shard_mod, "MAX_PENDING_WRITES", 1, raising=False)
    shard._store_host = lambda key, obj, header_end: None  # host memory refuses everything
    assert returns_within(shard.put, *_obj(0)) is True   # its write-down was queued
    assert returns_within(shard.put, *_obj(1)) is False  # stored nowhere: the client counts put_errors
