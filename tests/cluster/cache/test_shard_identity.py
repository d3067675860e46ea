"""Shard storage follows a stable identity of its machine, not the Ray node id (issue #18 item 4).

A Ray node restarted on the same machine gets a new node id, hence new shard actor names; its
shards must reopen the disk directories of their predecessors and find their chunks. Unit
tests of the naming and the directory lock run without Ray (lane ``unit``); the restart test
(lane ``cluster``) starts its own ``ray.cluster_utils.Cluster`` and shuts it down.
"""

from __future__ import annotations

import os
import socket
import uuid

import numpy as np
import pytest

from cluster.cache import identity
from tests.factories import make_key, make_object, shard_kv

RESOURCE = "kvblend_shard"


@pytest.mark.parametrize(("raw", "want"), [
    ("ip-10-0-3-7.ec2.internal", "ip-10-0-3-7.ec2.internal"),
    ("kvb-cache-shards-worker-x7k2p", "kvb-cache-shards-worker-x7k2p"),
    ("../../etc", "____etc"),      # no parent references, no separators
    ("a/b c:d", "a_b_c_d"),
    (".hidden", "hidden"),
])
@pytest.mark.unit
def test_sanitize_gives_one_safe_path_component(raw, want):
    assert identity.sanitize(raw) == want


@pytest.mark.unit
@pytest.mark.parametrize("raw", ["", "   ", "..", "/"])
def test_sanitize_rejects_names_with_nothing_usable(raw):
    with pytest.raises(ValueError, match="no usable characters"):
        identity.sanitize(raw)


@pytest.mark.unit
def test_node_name_is_the_variable_else_the_host_name():
    assert identity.node_name({"KVBLEND_NODE_NAME": "gpu-node-7"}) == "gpu-node-7"
    assert identity.node_name({"KVBLEND_NODE_NAME": "  "}) == identity.sanitize(socket.gethostname())
    assert identity.node_name({}) == identity.sanitize(socket.gethostname())


@pytest.mark.unit
def test_kvblend_node_name_is_a_known_variable_not_a_config_field():
    from cluster.config import load_config

    load_config(environ={"KVBLEND_NODE_NAME": "node-1"})  # an unknown KVBLEND_* would raise


@pytest.mark.unit
def test_a_locked_directory_is_not_opened_twice(tmp_path):
    """Two live shards with one node name and index (two hostPath pods on one Kubernetes
    node) get different directories; once the holder is gone its directory is free again."""
    first, fd1 = identity.claim_disk_dir(str(tmp_path), "node-a", 0)
    second, fd2 = identity.claim_disk_dir(str(tmp_path), "node-a", 0)
    other, fd3 = identity.claim_disk_dir(str(tmp_path), "node-a", 1)
    assert first == str(tmp_path / "node-a-0") and second == str(tmp_path / "node-a-0-b")
    assert other == str(tmp_path / "node-a-1")
    assert None not in (fd1, fd2, fd3)
    os.close(fd1)  # the holder exits (the kernel drops an flock with its process)
    again, fd4 = identity.claim_disk_dir(str(tmp_path), "node-a", 0)
    assert again == first
    for fd in (fd2, fd3, fd4):
        os.close(fd)


def _add_cache_node(cluster, name: str):
    return cluster.add_node(num_cpus=1, resources={RESOURCE: 1}, object_store_memory=100 * 2**20,
                            env_vars={"KVBLEND_NODE_NAME": name})


def _ready(names: list[str], ns: str) -> dict[int, dict]:
    """``{shard index: ready()}``."""
    import ray

    from cluster.cache.lifecycle import get_shard

    infos = [ray.get(get_shard(n, ns).ready.remote(), timeout=30) for n in names]
    return {int(info["name"].rsplit("-", 1)[1]): info for info in infos}


@pytest.mark.cluster
def test_restarted_node_finds_its_chunks_under_a_new_node_id(tmp_path):
    import ray
    from ray.cluster_utils import Cluster

    from cluster.cache.lifecycle import get_shard, start_shards, stop_shards
    from cluster.config import load_config
    from tiers.disk import DiskTier

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 100 * 2**20, "include_dashboard": False})
    node = _add_cache_node(cluster, "cache-node-1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvblend-identity-test", log_to_driver=False)
    cfg = load_config(environ={}, overrides={
        "ray_address": cluster.address, "ray_namespace": f"kvblend-identity-{uuid.uuid4().hex[:6]}",
        "cache_dir": str(tmp_path), "disk_path": str(tmp_path / "disk"), "host_size_gib": 0.004,
        "disk_size_gib": 0.05, "call_timeout_s": 10.0, "load_timeout_s": 10.0, "metrics": False, "compression": "none",
        "shards_per_node": 2})
    ns = cfg.cluster.ray_namespace
    try:
        before = start_shards(cfg)
        assert len(before) == 2
        old = _ready(before, ns)
        keys = {i: [make_key(31000 + 100 * i + j) for j in range(4)] for i in (0, 1)}
        objs = {k: make_object(k, shard_kv(31000 + n)) for n, k in enumerate(keys[0] + keys[1])}
        for i, name in enumerate(before):
            h = get_shard(name, ns)
            assert all(ray.get([h.put.remote(str(k), np.frombuffer(objs[k], np.uint8)) for k in keys[i]]))
            assert ray.get(h.drain.remote(30))  # written down to the disk tier
        # a file with a chunk's name and garbage inside: a miss after the restart, not a crash
        bad = make_key(31999)
        assert DiskTier(old[0]["disk_path"], 2**20, fsync=False).put(bad, b"\x00garbage" * 64)

        cluster.remove_node(node)  # the raylet goes away; the machine comes back as a new node
        _add_cache_node(cluster, "cache-node-1")
        cluster.wait_for_nodes()
        after = start_shards(cfg)
        assert len(after) == 2 and not set(after) & set(before)  # new node id, new actor names
        new = _ready(after, ns)

        for i, name in zip((0, 1), sorted(after), strict=True):
            h = get_shard(name, ns)
            assert ray.get(h.contains.remote([str(k) for k in keys[i]])) == [True] * 4
            hits = ray.get(h.lookup.remote([str(k) for k in keys[i]], prefetch=False))
            assert [hit[0] for hit in hits] == ["disk"] * 4
            refs = ray.get(h.get_refs.remote([str(k) for k in keys[i]]))
            for k, ref in zip(keys[i], refs, strict=True):
                assert bytes(ray.get(ref[0])) == objs[k]  # bit-exact
        h0 = get_shard(sorted(after)[0], ns)
        assert ray.get(h0.lookup.remote([str(bad)])) == [None]
        assert ray.get(h0.get_refs.remote([str(bad)])) == [None]

        disk = tmp_path / "disk"
        for i in (0, 1):
            assert new[i]["node_id"] != old[i]["node_id"]
            assert new[i]["node_name"] == old[i]["node_name"] == "cache-node-1"
            assert new[i]["disk_path"] == old[i]["disk_path"] == str(disk / f"cache-node-1-{i}")
        assert sorted(p.name for p in disk.iterdir()) == ["cache-node-1-0", "cache-node-1-1"]
        # the keys follow the node name too: the same owner before and after, through the
        # client's placement; the predecessors on the gone node are retired
        from cluster.cache.lifecycle import shard_names
        from cluster.cache.placement import Placement, placement_name

        assert shard_names(ns) == sorted(after)
        assert [placement_name(n) for n in sorted(after)] == [placement_name(n) for n in sorted(before)]
        all_keys = [str(k) for k in keys[0] + keys[1]]
        assert [placement_name(Placement(after).owner(k)) for k in all_keys] == \
            [placement_name(Placement(before).owner(k)) for k in all_keys]
    finally:
        stop_shards(ns)
        ray.shutdown()
        cluster.shutdown()
