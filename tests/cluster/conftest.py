"""One Ray cluster for the session (``ray_cluster``) and the cache on it, for the tests of
``tests/cluster/cache`` and ``tests/cluster/cli``: ``ray.cluster_utils.Cluster`` with 2 nodes on
this machine, each advertising the shard resource and naming itself (``KVBLEND_NODE_NAME``:
``test-node-a``, ``test-node-b``), small object stores (200 MB each), no dashboard, metrics
exported on a known port of the head. Shut down at the end of the session.

A module whose tests take ``ray_cluster`` (or a fixture built on it) carries the ``shared_ray``
marker, which runs it after every other test (see ``tests/conftest.py``).
"""

from __future__ import annotations

import uuid

import pytest

from cluster.workloads.services import free_port
from tests.factories import NAMESPACE

RESOURCE = "kvblend_shard"
OBJECT_STORE_BYTES = 200 * 2**20


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """``(cluster, metrics_port)``; the driver (this process) is connected to it."""
    import ray
    from ray.cluster_utils import Cluster

    metrics_port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {RESOURCE: 1}, "object_store_memory": OBJECT_STORE_BYTES,
        "include_dashboard": False, "metrics_export_port": metrics_port,
        "_system_config": {"metrics_report_interval_ms": 1000},
        "env_vars": {"KVBLEND_NODE_NAME": "test-node-a"},
    })
    # Both nodes run on this machine (one host name): each gets its own stable node name, as
    # distinct machines would, so their shards' disk directories differ without lock contention.
    cluster.add_node(num_cpus=1, resources={RESOURCE: 1}, object_store_memory=OBJECT_STORE_BYTES,
                     env_vars={"KVBLEND_NODE_NAME": "test-node-b"})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvblend-test-driver", log_to_driver=False)
    yield cluster, metrics_port
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def kvconfig(ray_cluster, tmp_path_factory):
    """A KVBlendConfig for the test cluster (unique Ray namespace, tmp disk tier)."""
    from cluster.config import load_config

    cluster, _ = ray_cluster
    root = tmp_path_factory.mktemp("kvblend")
    return load_config(environ={}, overrides={
        "ray_address": cluster.address, "ray_namespace": f"kvblend-test-{uuid.uuid4().hex[:6]}",
        "cache_dir": str(root), "disk_path": str(root / "disk"), "host_size_gib": 0.004,
        "disk_size_gib": 0.2, "call_timeout_s": 10.0, "load_timeout_s": 10.0, "compression": "lz4"})


@pytest.fixture(scope="session")
def shards(kvconfig):
    """Names of the shard actors (one per node), started once."""
    from cluster.cache.lifecycle import start_shards

    return start_shards(kvconfig)


@pytest.fixture
def client(kvconfig, shards):
    from cluster.cache.client import CacheClient

    c = CacheClient(kvconfig, namespace=NAMESPACE)
    yield c
    c.close()

