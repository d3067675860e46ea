"""The cache agent hands freed heap back after the requests that carry large buffers (issue
20's soak: the agent's main heap kept +52 MiB of freed put buffers after a shard_sigstop
phase). In-process :class:`cluster.cache.agent.Agent` over a socket pair, with a stand-in
Ray transport and a :class:`cluster.heap.HeapTrimmer` whose trim and timer are recorded."""

from __future__ import annotations

import socket

import pytest
import torch

from cluster.cache.agent import Agent
from cluster.cache.ops import LookupAnswer, ObjectsAnswer, PutRequest, request_frame
from cluster.cache.wire import recv_frame
from cluster.heap import HeapTrimmer
from tests.factories import make_key
from tiers.codec import encode_kv

pytestmark = pytest.mark.unit


class _Transport:
    """What the agent calls on its RayTransport for put, lookup and stats (a put settles at once)."""

    def __init__(self):
        self.puts = []

    def put(self, request, done):
        self.puts.append((request.key, bytes(request.obj)))
        done(True)
        return True

    def lookup(self, request):
        return LookupAnswer((None,) * len(request.keys))

    def stats(self, request):
        return {"shards": {"shard-0": {"puts": len(self.puts)}}}


class _Timer:
    def __init__(self, delay_s, fn):
        self.delay_s, self.fn, self.cancelled = delay_s, fn, False

    def start(self):
        pass

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def agent():
    ours, theirs = socket.socketpair()
    trims, timers, now = [], [], [100.0]

    def timer(delay_s, fn):
        timers.append(_Timer(delay_s, fn))
        return timers[-1]

    a = Agent(ours)
    a.heap = HeapTrimmer(5.0, on_trim=a._trimmed, clock=lambda: now[0], trim=trims.append, timer=timer)
    a.transport = _Transport()
    yield a, theirs, trims, timers, now
    ours.close()
    theirs.close()


def _put_frame(i: int):
    """A put frame as the vLLM side sends it: one chunk object, encoded there."""
    key = make_key(4100 + i)
    obj = encode_kv(key, torch.full((2, 2, 4, 1, 8), float(i), dtype=torch.float16))
    message, _ = request_frame("put", PutRequest(key, b""))
    return {"id": i, **message}, [bytearray(obj)], obj


def test_a_put_frees_its_buffer_and_asks_for_a_trim(agent):
    a, peer, trims, timers, now = agent
    message, buffers, obj = _put_frame(1)
    a.answer(message, buffers)
    reply, _ = recv_frame(peer)
    assert reply == {"id": 1, "ok": True, "result": True}  # stored: the shard's put settled
    assert a.transport.puts[0] == (make_key(4101), obj), "forwarded as encoded: not decoded, not re-encoded"
    assert buffers == [], "the frame's buffer is released before the trim, not when the pool drops the call"
    assert trims == [0] and a.heap_trims == 1

    # a burst inside the interval: one trailing trim armed (for when it ends, 4 s after the
    # second put), none per put
    for i in (2, 3, 4):
        now[0] += 1.0
        a.answer(*_put_frame(i)[:2])
        recv_frame(peer)
    assert trims == [0] and len(timers) == 1 and timers[0].delay_s == pytest.approx(4.0)
    timers[0].fn()  # the interval ended: the agent went idle after the burst
    assert trims == [0, 0] and a.heap_trims == 2


def test_lookups_do_not_trim_and_stats_report_the_trims(agent):
    a, peer, trims, timers, _ = agent
    a.answer({"id": 7, "op": "lookup", "keys": [str(make_key(4200))]}, [])
    assert recv_frame(peer)[0] == {"id": 7, "ok": True, "result": {"hits": [None], "unanswered": []}}
    assert trims == [] and timers == []
    a.answer(*_put_frame(8)[:2])
    recv_frame(peer)
    a.answer({"id": 9, "op": "stats"}, [])
    stats = recv_frame(peer)[0]["result"]
    assert stats["agent"]["heap_trims"] == 1 and stats["shards"] == {"shard-0": {"puts": 1}}


def test_a_failed_put_still_frees_its_buffer_and_trims(agent):
    a, peer, trims, _, _ = agent

    def broken_put(request, done):
        raise MemoryError("object store full")

    a.transport.put = broken_put
    message, buffers, _ = _put_frame(11)
    a.answer(message, buffers)
    reply, _ = recv_frame(peer)
    assert reply["ok"] is False and "MemoryError" in reply["error"]
    assert buffers == [] and trims == [0]


def test_objects_over_what_the_vllm_side_accepts_are_answered_as_misses(agent):
    """The vLLM side refuses a buffer over its limit by closing the link; the agent learns the
    limit in hello and answers such an object as a miss instead (before: one large object
    killed the link, and the agent restarted, every time it was asked for)."""
    import numpy as np

    a, peer, *_ = agent
    small, big = np.frombuffer(b"s" * 64, np.uint8), np.frombuffer(b"b" * 4096, np.uint8)
    a.transport.objects = lambda request: ObjectsAnswer((small, big), (True, True))
    a.max_buffer_bytes = 1024
    a.answer({"id": 12, "op": "objects", "keys": [str(make_key(4300)), str(make_key(4301))]}, [])
    reply, buffers = recv_frame(peer)
    assert reply["result"]["where"] == ["host", None] and [bytes(b) for b in buffers] == [bytes(small)]
    assert a.counters["answers_oversized"] == 1
