"""A stalled disk (issue #20: disk I/O per-call deadlines): a chunk file is a FIFO
(:func:`cluster.workloads.faults.stalled_file`), so opening it blocks in the kernel, where no
Python timeout reaches. Once that call has run past ``io_timeout_s`` the disk tier refuses
every new call at once (misses, failed puts, ``io_refused``) instead of queueing threads
behind it; when the call returns it is counted (``io_timeouts``) and calls are admitted again,
bit-exact. Through a shard: the lookup still answers (its deadline), lookups and reads of the
other chunks are misses while the disk is stalled, then hit from disk again. The only timing
is the hang guard."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cluster.workloads.faults import stalled_file
from tests.factories import (
    make_key,
    make_kv,
    make_object,
    ray_free_shard,
    returns_within,
    stop_shard,
)
from tiers.codec import layer_tensor
from tiers.config import TiersConfig
from tiers.disk import DiskTier
from tiers.format import decode_layer, parse_header

pytestmark = pytest.mark.unit

HANG_S = 90.0


def _until(check, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _lookup(shard, keys):
    got = returns_within(lambda: shard.lookup([str(k) for k in keys], prefetch=False), hang_s=HANG_S)
    return [None if g is None else g[0] for g in got]


def test_stalled_disk_refuses_new_calls_then_recovers_exact(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, fsync=False, io_timeout_s=0.1)
    stuck, ok, new = make_key(1), make_key(2), make_key(3)
    objs = {k: make_object(k, make_kv(i)) for i, k in enumerate((stuck, ok, new))}
    assert tier.put(stuck, objs[stuck]) and tier.put(ok, objs[ok])

    got: list = []
    with stalled_file(tier, stuck):
        reader = threading.Thread(target=lambda: got.append(tier.get(stuck)), daemon=True)
        reader.start()
        _until(lambda: tier._watch.stalled, "the blocked read never counted as stalled")
        # every call is refused at once while the read is stuck: no thread queues behind it
        assert returns_within(tier.get, ok, hang_s=HANG_S) is None
        assert returns_within(tier.head, ok, 64, hang_s=HANG_S) is None
        assert returns_within(tier.get_ranges, ok, [(0, 16)], hang_s=HANG_S) is None
        assert returns_within(tier.put, new, objs[new], hang_s=HANG_S) is False
        assert tier.contains([new]) == [False]  # a refused put leaves no index entry
        assert tier.stats()["io_refused"] == 4 and tier.stats()["io_timeouts"] == 0
        assert reader.is_alive()
    reader.join(HANG_S)
    assert not reader.is_alive() and got == [None]  # released: it read nothing, a miss
    stats = tier.stats()
    assert stats["io_timeouts"] == 1 and stats["io_refused"] == 4 and not tier._watch.stalled
    # admitted again, bit-exact; the stalled key's file is gone and the index forgets it
    assert tier.get(ok) == objs[ok]
    assert tier.put(new, objs[new]) and tier.get(new) == objs[new]
    assert tier.get(stuck) is None and tier.contains([stuck]) == [False]


def test_stalled_disk_answers_lookups_refuses_calls_then_serves_exact(monkeypatch, tmp_path):
    cfg = TiersConfig(host_size_gib=0.01, disk_size_gib=0.01, io_timeout_s=0.2, lookup_timeout_s=1.0)
    shard = ray_free_shard(monkeypatch, tmp_path, cfg)
    objects = {}

    def store_host(key, obj, header_end):  # keep each host object's bytes, to check reads
        data = bytes(memoryview(obj).cast("B"))
        if not shard.host.put_object(key, (f"ref:{key}", data[:header_end], len(data)), len(data)):
            return None
        objects[f"ref:{key}"] = data
        return f"ref:{key}"

    shard._store_host = store_host
    try:
        keys = [make_key(800 + i) for i in range(3)]
        kvs = [make_kv(800 + i) for i in range(3)]
        for k, kv in zip(keys, kvs, strict=True):
            assert shard.put(str(k), np.frombuffer(make_object(k, kv), np.uint8))
        assert returns_within(shard.drain, hang_s=HANG_S)
        shard.host.delete(keys)
        assert _lookup(shard, keys) == ["disk"] * 3
        shard.host.delete(keys)  # a lookup may prefetch; reads below must come from disk
        stuck, others = keys[0], keys[1:]

        with stalled_file(shard.disk, stuck):
            timeouts = shard.counters["lookup_timeouts"]
            assert _lookup(shard, [stuck]) == [None]  # the header read hangs: late, a miss
            assert shard.counters["lookup_timeouts"] == timeouts + 1
            _until(lambda: shard.disk._watch.stalled, "the blocked header read never counted as stalled")
            assert _lookup(shard, others) == [None, None]  # refused at once, not queued
            assert returns_within(shard.get_refs, [str(k) for k in others], 30.0, hang_s=HANG_S) == [None, None]
            assert shard.disk.stats()["io_refused"] >= 2
        _until(lambda: not shard.disk._watch.stalled, "the released read never returned")
        assert shard.disk.stats()["io_timeouts"] >= 1

        assert _lookup(shard, others) == ["disk", "disk"]
        refs = returns_within(shard.get_refs, [str(k) for k in others], 30.0, hang_s=HANG_S)
        for key, kv, ref in zip(others, kvs[1:], refs, strict=True):
            obj = objects[ref[0]]
            header = parse_header(obj, expected_key=key)
            layers = [layer_tensor(decode_layer(header, i, obj[e.offset:e.offset + e.stored_len]),
                                   header.layer_shape, header.dtype) for i, e in enumerate(header.layers)]
            assert torch.equal(torch.stack(layers), kv)
        assert _lookup(shard, [stuck]) == [None]  # its file is gone
    finally:
        stop_shard(shard)
        if shard.lower_stack is not None:
            shard.lower_stack.close(timeout_s=30)
