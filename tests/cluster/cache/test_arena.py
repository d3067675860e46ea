"""The shared-memory arena between vLLM's process and its cache agent (issue 32): slots are
bounded and come back (with their last view, on a miss, on a late or refused answer, when the
agent is gone), the agent writes only into slots it was given, and a full arena is a counted
miss, never a wait. In-process: the agent's side is an :class:`ArenaWriter` over a duplicate
of the memfd, the link a stand-in ``call``."""

from __future__ import annotations

import gc
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cluster.cache.agent_objects import AgentObjects
from cluster.cache.arena import ALIGN, Arena, ArenaWriter
from tests.factories import make_key, make_object, shard_kv

pytestmark = pytest.mark.unit


def _counter():
    counts: dict[str, int] = {}

    def count(name, n=1):
        counts[name] = counts.get(name, 0) + n
    return counts, count


def _agent_call(arena: Arena, objects: dict, log: list, *, answer=True, oversize=()):
    """A stand-in for the agent's ``objects`` op: writes each known object into its slot with
    an :class:`ArenaWriter` (a second mapping of the same memfd), answers where and sizes."""
    writer = ArenaWriter(os.dup(arena.fd), arena.nbytes)

    def call(message, on_done):
        log.append(message)
        where, sizes = [], []
        for k, (off, cap) in zip(message["keys"], message["slots"], strict=True):
            obj = objects.get(k)
            if obj is None:
                where.append(None)
                sizes.append(None)
            elif len(obj) > cap or k in oversize:
                where.append("refit")
                sizes.append(len(obj) + (cap if k in oversize else 0))
            else:
                sizes.append(writer.write(off, cap, obj))
                where.append("host")
        fut = SimpleNamespace()
        if not answer:  # the caller's wait ran out: the answer (and on_done) come later
            log.append(lambda: on_done(fut))
            return None
        on_done(fut)
        return {"where": where, "sizes": sizes}, []
    return call


def test_slots_are_bounded_coalesce_and_come_back_with_their_last_view():
    arena = Arena(16 * ALIGN)
    slots = [arena.reserve(ALIGN * 4) for _ in range(4)]
    assert all(s is not None for s in slots) and arena.reserve(1) is None  # full: refused, no wait
    assert arena.stats()["arena_used_bytes"] == arena.nbytes
    slots[1].release()
    slots[2].release()
    big = arena.reserve(ALIGN * 8)  # the two freed neighbours merged
    assert big is not None and big.offset == slots[1].offset
    view = slots[0].view(100)
    part = view[10:20]
    del view
    gc.collect()
    assert arena.reserve(ALIGN) is None  # a view of slot 0 is still held
    del part
    gc.collect()
    assert arena.reserve(ALIGN) is not None
    with pytest.raises(ValueError):
        slots[3].view(slots[3].nbytes + 1)
    arena.retire()
    assert arena.reserve(1) is None  # a retired arena hands nothing out


def test_the_writer_writes_only_inside_the_arena_and_only_what_fits():
    arena = Arena(64 << 20)
    writer = ArenaWriter(os.dup(arena.fd), arena.nbytes)
    slot = arena.reserve(40 << 20)
    data = np.random.default_rng(0).integers(0, 256, 33 << 20, dtype=np.uint8)  # parallel copy
    assert writer.write(slot.offset, slot.nbytes, data) == data.nbytes
    assert np.array_equal(slot.view(data.nbytes), data)  # bit-exact through the other mapping
    for offset, cap, obj in ((arena.nbytes - 8, 64, b"x" * 16), (-1, 64, b"x"), (0, 4, b"x" * 8)):
        with pytest.raises(ValueError):
            writer.write(offset, cap, obj)
    with pytest.raises(ValueError):  # a descriptor of another size than hello says
        ArenaWriter(os.dup(arena.fd), arena.nbytes + ALIGN)


def test_objects_come_through_the_arena_bit_exact_and_are_kept_then_dropped_for_room():
    keys = [make_key(98100 + i) for i in range(3)]
    kvs = [shard_kv(i, num_tokens=32) for i in range(3)]
    objects = {str(k): make_object(k, kv) for k, kv in zip(keys, kvs, strict=True)}
    size = len(next(iter(objects.values())))
    counts, count = _counter()
    held = AgentObjects(count)
    arena = held.new_arena(2 * size + 2 * ALIGN)  # room for two objects
    log: list = []
    call = _agent_call(arena, objects, log)
    for k in keys:
        held.note_size(k, size + 64)
    got = held.read(keys[:2], call)
    for (arr, header, shared), kv in zip(got, kvs[:2], strict=True):
        assert not shared and header.num_layers == kv.shape[0]
        e = header.layers[1]
        layer = torch.frombuffer(bytearray(arr[e.offset:e.offset + e.stored_len]), dtype=kv.dtype)
        assert torch.equal(layer.view(kv[1].shape), kv[1])
    assert held.read(keys[:2], call)[0] is got[0] and len(log) == 1  # kept: no second call
    del got, arr, header, layer  # no view of the first two left here
    assert held.read(keys[2:], call)[0] is not None  # room made by dropping the oldest kept object
    assert counts.get("arena_full", 0) == 0
    assert held.read(keys[:1], call)[0] is not None  # keys[0] read again (it was dropped)
    assert held.read(keys, call)[1] is None  # three objects never fit an arena of two
    assert counts["arena_full"] == 1


def test_a_full_arena_is_a_counted_miss_and_a_larger_object_is_refitted():
    key, other = make_key(98200), make_key(98201)
    obj = make_object(key, shard_kv(1, num_tokens=64))
    counts, count = _counter()
    held = AgentObjects(count)
    arena = held.new_arena(len(obj) + ALIGN)
    log: list = []
    call = _agent_call(arena, {str(key): obj, str(other): obj}, log)
    held.note_size(key, 100)  # the lookup's bound was too small (re-encoded since)
    held.note_size(other, 100)
    (got,) = held.read([key], call)
    assert got is not None and counts["arena_refits"] == 1 and len(log) == 2
    held.note_size(other, len(obj))
    assert held.read([key, other], call)[1] is None  # no room while key's object is in use
    assert counts["arena_full"] == 1 and len(log) == 2  # refused here: no call, no wait


def test_slots_of_a_late_answer_come_back_only_when_the_call_ends():
    key = make_key(98300)
    obj = make_object(key, shard_kv(2, num_tokens=16))
    counts, count = _counter()
    held = AgentObjects(count)
    arena = held.new_arena(4 << 20)
    log: list = []
    held.note_size(key, len(obj))
    assert held.read([key], _agent_call(arena, {str(key): obj}, log, answer=False)) == [None]
    assert arena.stats()["arena_used_bytes"] > 0  # the agent may still write there
    log[-1]()  # the answer arrives after the wait
    assert arena.stats()["arena_used_bytes"] == 0


def test_a_lost_agent_retires_its_arena_and_views_stay_readable():
    key = make_key(98400)
    kv = shard_kv(3, num_tokens=16)
    obj = make_object(key, kv)
    counts, count = _counter()
    held = AgentObjects(count)
    arena = held.new_arena(4 << 20)
    held.note_size(key, len(obj))
    (got,) = held.read([key], _agent_call(arena, {str(key): obj}, []))
    view = got[0]
    held.retire()  # the agent died: nothing of its arena is handed out again
    assert arena.retired and arena.reserve(1) is None and held.arena is None
    assert bytes(view) == obj  # a reader that holds a view still reads the same bytes
    fresh = held.new_arena(4 << 20)
    assert fresh is not arena and fresh.stats()["arena_used_bytes"] == 0


def test_concurrent_reads_never_share_a_slot():
    keys = [make_key(98500 + i) for i in range(16)]
    objects = {str(k): make_object(k, shard_kv(i, num_tokens=16)) for i, k in enumerate(keys)}
    counts, count = _counter()
    held = AgentObjects(count)
    arena = held.new_arena(64 << 20)
    call = _agent_call(arena, objects, [])
    for k in keys:
        held.note_size(k, len(objects[str(k)]))
    errors = []

    def worker(i):
        for n in range(20):
            mine = [keys[(i + n) % 16], keys[(i + 2 * n + 1) % 16]]
            held.forget(mine)
            for k, got in zip(mine, held.read(mine, call), strict=True):
                if got is None or bytes(got[0]) != objects[str(k)]:
                    errors.append(k)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and counts.get("arena_full", 0) == 0


def test_the_agent_writes_objects_into_named_slots_and_says_refit_or_refuses():
    from cluster.cache.agent import Agent

    arena = Arena(1 << 20)
    a = Agent(None)
    a.arena = ArenaWriter(os.dup(arena.fd), arena.nbytes)
    small, big = b"s" * 100, b"b" * 9000
    header = SimpleNamespace(total_bytes=0)
    a.client = SimpleNamespace(map_for_read=lambda keys: ([SimpleNamespace(header=header)] * 3,
                                                          [(small, None), (big, None), (small, None)]))
    keys = [make_key(98600 + i) for i in range(3)]
    s1, s2 = arena.reserve(ALIGN), arena.reserve(ALIGN)
    got = a.objects_into_arena(keys, [[s1.offset, s1.nbytes], [s2.offset, s2.nbytes],
                                      [arena.nbytes - 10, ALIGN]])
    assert got.to_wire() == {"where": ["host", "refit", None], "sizes": [100, 9000, None]}
    assert bytes(s1.view(100)) == small and a.arena_refused == 1
