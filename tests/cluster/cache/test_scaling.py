"""Adding shards to a running deployment: re-running start_shards is idempotent (existing
shards untouched), new shards join the placement, moved keys become misses and are counted."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from tests.factories import NAMESPACE, make_key, shard_kv

pytestmark = pytest.mark.cluster


def test_new_shards_move_keys_which_become_counted_misses(ray_cluster, tmp_path_factory):
    import ray

    from cluster.cache.client import CacheClient
    from cluster.cache.lifecycle import get_shard, start_shards, stop_shards
    from cluster.cache.placement import Placement
    from cluster.config import load_config

    cluster, _ = ray_cluster
    cfg = load_config(environ={}, overrides={
        "ray_address": cluster.address, "ray_namespace": f"kvblend-scale-{uuid.uuid4().hex[:6]}",
        "cache_dir": str(tmp_path_factory.mktemp("scale")), "host_size_gib": 0.004,
        "disk_size_gib": 0.0, "call_timeout_s": 10.0, "load_timeout_s": 10.0, "metrics": False})
    ns = cfg.cluster.ray_namespace
    try:
        first = start_shards(cfg)
        assert len(first) == 2
        pids = {n: ray.get(get_shard(n, ns).ready.remote())["pid"] for n in first}
        client = CacheClient(cfg, NAMESPACE)
        keys = [make_key(11000 + i) for i in range(40)]
        for i, k in enumerate(keys):
            client.put(k, shard_kv(i, num_layers=2, num_tokens=4))
        assert client.flush(60)
        assert all(m is not None for m in client.lookup(keys))

        more = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, shards_per_node=2))
        both = start_shards(more)
        assert len(both) == 4 and set(first) < set(both)
        for n in first:  # get_if_exists: the running shards were not replaced
            assert ray.get(get_shard(n, ns).ready.remote())["pid"] == pids[n]

        old, new = Placement(first), Placement(both)
        moved = [k for k in keys if old.owner(str(k)) != new.owner(str(k))]
        assert 0 < len(moved) <= 1.5 * len(keys) * 2 / 4  # 2 of 4 shards are new
        client.transport.router.refresh(force=True)
        assert client.counters["placement_moves"] == len(moved)
        metas = client.lookup(keys)
        for k, m in zip(keys, metas, strict=True):
            assert (m is None) == (k in moved)  # moved keys are misses (no migration)
        stay = [k for k in keys if k not in moved]
        got = client.fetch_layer(stay, 1).result(30)
        assert all(torch.equal(g, shard_kv(keys.index(k), num_layers=2, num_tokens=4)[1])
                   for k, g in zip(stay, got, strict=True))
        client.close()
    finally:
        stop_shards(ns)
