"""The cache client over real shard actors on a 2-node Ray cluster: round trips, sharing, spread;
the contract's tests run over every transport (``any_client``: the shards from this process, a
cache agent, a tier in this process)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.factories import NAMESPACE, make_key, make_prefix_key, shard_kv, sibling_client

pytestmark = pytest.mark.cluster


def test_one_shard_per_node(ray_cluster, shards, kvconfig):
    import ray

    from cluster.cache.lifecycle import get_shard

    cluster, _ = ray_cluster
    assert len(shards) == 2
    infos = [ray.get(get_shard(n, kvconfig.cluster.ray_namespace).ready.remote()) for n in shards]
    assert len({i["node_id"] for i in infos}) == 2  # one per node
    for info in infos:
        assert info["name"] in shards and info["node_id"][:8] in info["name"]
        # the disk directory follows the node's stable name, not its Ray node id
        assert info["node_name"] in ("test-node-a", "test-node-b")
        assert os.path.basename(info["disk_path"]).startswith(f"{info['node_name']}-0")


def test_put_lookup_fetch_round_trip(any_client):
    client = any_client
    keys = [make_key(100 + i) for i in range(12)]
    kvs = [shard_kv(i, num_tokens=8 + i) for i in range(12)]
    for k, kv in zip(keys, kvs, strict=True):
        client.put(k, kv)
    assert client.flush(30)
    metas = client.lookup(keys + [make_key(999)])
    assert metas[-1] is None
    for k, kv, m in zip(keys, kvs, metas[:-1], strict=True):
        assert m is not None and m.key == k and m.num_tokens == kv.shape[2]
        assert m.positions == tuple(range(kv.shape[2])) and m.tier == "host"
    for layer in range(4):
        got = client.fetch_layer(keys, layer).result(30)
        for kv, t in zip(kvs, got, strict=True):
            assert t is not None and t.shape == kv[layer].shape and t.dtype == kv.dtype
            assert torch.equal(t, kv[layer])
    if client.transport.remote:  # both shards got some keys (placement spreads a batch)
        assert len({client._meta[k].shard for k in keys}) == 2


def test_positions_survive(any_client):
    client = any_client
    k = make_prefix_key(200)  # a prefix chunk: a segment's positions are canonical
    kv = shard_kv(7, num_tokens=5)
    client.put(k, kv, positions=[10, 11, 12, 30, 31])
    assert client.flush(30)
    (m,) = client.lookup([k])
    assert m.positions == (10, 11, 12, 30, 31)


def test_put_is_idempotent_and_delete(any_client):
    client = any_client
    k = make_key(300)
    client.put(k, shard_kv(1))
    client.put(k, shard_kv(2))  # ignored: first wins
    assert client.flush(30)
    assert client.contains([k]) == [True]
    got = client.fetch_layer([k], 0).result(30)[0]
    assert torch.equal(got, shard_kv(1)[0])
    assert client.delete([k]) == 1
    assert client.contains([k]) == [False]
    assert client.lookup([k]) == [None]


def test_fetch_without_lookup_and_past_last_layer(any_client):
    client = any_client
    k = make_key(400)
    kv = shard_kv(4)
    client.put(k, kv)
    assert client.flush(30)
    fresh = sibling_client(client)
    try:
        assert torch.equal(fresh.fetch_layer([k], 3).result(30)[0], kv[3])
        assert fresh.fetch_layer([k, make_key(401)], 9).result(30) == [None, None]
    finally:
        fresh.close()


def test_mapped_objects_are_bounded_by_bytes(kvconfig, shards):
    from cluster.cache.client import CacheClient

    keys = [make_key(500 + i) for i in range(8)]
    kvs = [shard_kv(500 + i) for i in range(8)]
    writer = CacheClient(kvconfig, NAMESPACE)
    for k, kv in zip(keys, kvs, strict=True):
        writer.put(k, kv)
    assert writer.flush(30)
    one = len(writer.fetch_layer(keys[:1], 0).result(30)) and writer.objects.get(keys[0])[0].nbytes
    reader = CacheClient(kvconfig, NAMESPACE, max_mapped_bytes=3 * one)
    for layer in range(4):
        got = reader.fetch_layer(keys, layer).result(30)
        assert all(torch.equal(g, kv[layer]) for g, kv in zip(got, kvs, strict=True))
        assert 1 <= len(reader.objects) <= 3
    for c in (writer, reader):
        c.close()


def test_ray_client_is_a_cache_client_and_runs_its_thread_initializer(kvconfig, shards):
    import threading

    from cluster.cache.client import CacheClient
    from cluster.cache.protocol import CacheClientProtocol

    started: list[str] = []
    c = CacheClient(kvconfig, NAMESPACE,
                    thread_initializer=lambda: started.append(threading.current_thread().name))
    try:
        assert isinstance(c, CacheClientProtocol)
        assert c.fetch_layer([make_key(600)], 0).result(30) == [None]  # never stored: a miss
        assert started and all(name.startswith("kvblend-client") for name in started)
    finally:
        c.close()


def test_host_layers_stage_the_mapped_objects_bit_exact(any_client):
    client = any_client
    """What a CUDA worker stages from (``host_layers()``, through tiers.staging.StagedSource;
    here on the CPU): zero-copy views of the mapped objects, every layer of a request from
    one ``fetch_layers`` call, bit for bit; a key nobody holds is None in its slot."""
    from tiers.staging import StagedSource

    keys = [make_key(700 + i) for i in range(5)]
    kvs = [shard_kv(i, num_tokens=6 + i) for i in range(5)]
    for k, kv in zip(keys, kvs, strict=True):
        client.put(k, kv)
    assert client.flush(30)
    layers = client.host_layers()
    headers = layers.headers(keys)
    assert all(h is not None for h in headers)
    assert all(layers.layer_views(k, h) is not None for k, h in zip(keys, headers, strict=True))
    src = StagedSource(layers, "cpu")
    try:
        wanted = keys + [make_key(799)]
        for layer, fut in enumerate(src.fetch_layers(wanted, range(4))):
            got = fut.result(60)
            assert got[-1] is None
            for kv, t in zip(kvs, got, strict=False):
                assert torch.equal(t, kv[layer])
    finally:
        src.close()


def test_in_place_writes_to_fetched_layers_never_change_the_stored_chunk(any_client):
    """Ray hands out numpy arrays from its object store zero-copy (#20: Ray zero-copy tensors).
    The engine writes into the KV it gets (K is re-rotated in place): a fetched layer is a
    copy, and the mapped object's own views are read-only, so the next reader, in this process
    or another, gets the chunk as stored."""
    import numpy as np

    client = any_client
    key, kv = make_key(750), shard_kv(750)
    client.put(key, kv)
    assert client.flush(30)
    assert client.lookup([key])[0] is not None
    for layer in range(4):
        (got,) = client.fetch_layer([key], layer).result(30)
        got.add_(1.0)  # what a blend does to K when it re-rotates it
        got.view(torch.uint8).fill_(0xFF)
    assert all(torch.equal(client.fetch_layer([key], i).result(30)[0], kv[i]) for i in range(4))
    layers = client.host_layers()  # what a CUDA worker stages from: the mapped object itself
    views = layers.layer_views(key, layers.headers([key])[0])
    assert views is not None and all(not np.asarray(v).flags.writeable for v in views)
    with pytest.raises(ValueError):
        np.asarray(views[0])[:1] = 0
    other = sibling_client(client)
    try:
        assert other.lookup([key])[0] is not None
        assert all(torch.equal(other.fetch_layer([key], i).result(30)[0], kv[i]) for i in range(4))
    finally:
        other.close()
