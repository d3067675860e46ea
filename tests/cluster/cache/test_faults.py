"""Faults: a shard killed during reads, restarted with its disk chunks; a ref whose owner died
(Ray PR #63694); corrupted objects."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.factories import NAMESPACE, make_key, returns_within, shard_kv, wait_gone

pytestmark = pytest.mark.cluster


def _wait_ready(handle, old_pid: int, timeout_s: float = 90.0) -> dict:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = ray.get(handle.ready.remote(), timeout=5)
            if info["pid"] != old_pid:
                return info
        except Exception:  # noqa: BLE001 - still restarting
            pass
        time.sleep(0.5)
    raise AssertionError("shard did not restart")


def test_kill_shard_during_reads_then_disk_chunks_found(client, kvconfig, shards):
    import ray

    from cluster.cache.lifecycle import get_shard

    keys = [make_key(5000 + i) for i in range(20)]
    kvs = [shard_kv(5000 + i) for i in range(20)]
    for k, kv in zip(keys, kvs, strict=True):
        client.put(k, kv)
    assert client.flush(60)  # includes the shards' disk writes
    metas = client.lookup(keys)
    assert all(m is not None and m.tier == "host" for m in metas)
    victim = client._meta[keys[0]].shard
    victim_keys = [k for k in keys if client._meta[k].shard == victim]
    other = [i for i, k in enumerate(keys) if client._meta[k].shard != victim]
    handle = get_shard(victim, kvconfig.cluster.ray_namespace)
    old_pid = ray.get(handle.ready.remote())["pid"]

    errors: list[BaseException] = []
    results: list[list] = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                client.lookup(keys)
                results.append(client.fetch_layer(keys, 1).result(60))
            except BaseException as e:  # noqa: BLE001 - the assertion is that none happens
                errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.5)
    ray.kill(handle, no_restart=False)
    info = _wait_ready(handle, old_pid)
    time.sleep(0.5)
    stop.set()
    t.join(120)
    assert not errors, errors
    assert results, "reads never completed"
    for got in results:  # every read completed: a tensor that is right, or a miss
        for i, (kv, g) in enumerate(zip(kvs, got, strict=True)):
            assert g is None or torch.equal(g, kv[1])
            if i in other:
                assert g is not None  # the live shard kept serving
    assert client.counters["shard_errors"] + client.counters["timeouts"] > 0

    # the restarted shard (same name, same disk directory) finds its chunks on disk
    assert info["name"] == victim
    client.transport.router.refresh(force=True)
    client.transport.router.handles.clear()
    client.transport.router.suspect.clear()
    client.drop_objects()  # forget the mapped objects: read through the restarted shard
    client._meta.clear()
    metas = client.lookup(victim_keys)
    assert all(m is not None for m in metas)
    assert {m.tier for m in metas} <= {"disk", "host"}  # host once a read promoted it
    got = client.fetch_layer(victim_keys, 3).result(60)
    for k, g in zip(victim_keys, got, strict=True):
        assert torch.equal(g, kvs[keys.index(k)][3])
    st = ray.get(handle.stats.remote())
    # a fresh process: everything it serves came up from its disk tier
    assert st["pid"] == info["pid"]
    assert st["counters"]["promotions"] >= len(victim_keys)
    assert st["counters"]["hits_disk"] >= 1 and st["counters"]["prefetch_started"] >= 1
    assert st["tiers"]["disk"]["num_chunks"] >= len(victim_keys)


def test_a_ref_whose_owner_died_is_a_miss_within_the_call_deadline(client, kvconfig, shards, monkeypatch):
    """Ray PR #63694 (``ray.get`` of a ref whose owner died could hang): a reader holds the
    chunks' ``ObjectRef``\\ s from the owning shard's ``get_refs``, and the shard dies (its
    process gone) before the reader gets them. The read returns (the client's get waits at most
    ``call_timeout_s``, 10 s here; a 60-s hang guard is the only timing), each of those chunks a
    miss or its exact bytes, never an exception; the client counts the failed gets."""
    import ray

    from cluster.cache.client import CacheClient
    from cluster.cache.lifecycle import get_shard

    keys = [make_key(6100 + i) for i in range(8)]
    kvs = [shard_kv(6100 + i) for i in range(8)]
    for k, kv in zip(keys, kvs, strict=True):
        client.put(k, kv)
    assert client.flush(60)
    reader = CacheClient(kvconfig, namespace=NAMESPACE)  # nothing mapped yet: it asks for refs
    assert all(m is not None for m in reader.lookup(keys))
    victim = reader._meta[keys[0]].shard
    victim_keys = [k for k in keys if reader._meta[k].shard == victim]
    handle = get_shard(victim, kvconfig.cluster.ray_namespace)
    old_pid = ray.get(handle.ready.remote(), timeout=60)["pid"]
    try:
        real_refs = reader.transport.refs  # the seam between refs and gets
        held: list[int] = []

        def refs_then_owner_dies(ks, timeout_s):
            got = real_refs(ks, timeout_s)
            held.append(len(got[1]))
            ray.kill(handle, no_restart=False)
            wait_gone(old_pid)  # gone before the get starts
            return got

        monkeypatch.setattr(reader.transport, "refs", refs_then_owner_dies)
        got = returns_within(lambda: reader.fetch_layer(victim_keys, 1).result(60), hang_s=60.0,
                             what="ray.get of refs whose owner died")
        monkeypatch.undo()
        assert held == [len(victim_keys)], "the reader held a ref for every chunk of the dead shard"
        for k, g in zip(victim_keys, got, strict=True):
            assert g is None or torch.equal(g, kvs[keys.index(k)][1])
        misses = sum(g is None for g in got)
        assert reader.counters["shard_errors"] >= misses and misses == reader.counters["layer_misses"]
    finally:
        reader.close()
        _wait_ready(handle, old_pid)  # the session's shard serves the next tests


def test_corrupted_put_is_rejected_and_foreign_object_is_a_miss(client, kvconfig, shards):
    import ray

    from cluster.cache.lifecycle import get_shard
    from tiers.codec import encode_kv

    k, other = make_key(6000), make_key(6001)
    obj = bytearray(encode_kv(k, shard_kv(1)))
    obj[-5] ^= 0xFF  # flip a byte of the last layer
    h = get_shard(shards[0], kvconfig.cluster.ray_namespace)
    assert ray.get(h.put.remote(str(k), np.frombuffer(bytes(obj), np.uint8))) is False
    # an object holding another key's KV, stored under this key: refused as well
    foreign = encode_kv(other, shard_kv(2))
    assert ray.get(h.put.remote(str(k), np.frombuffer(foreign, np.uint8))) is False
    assert ray.get(h.stats.remote())["counters"]["put_rejected"] >= 2
    assert ray.get(h.contains.remote([str(k)])) == [False]
