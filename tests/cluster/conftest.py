"""One Ray cluster for the lane process and the cache on it, for the tests of
``tests/cluster/cache`` and ``tests/cluster/cli``: ``ray.cluster_utils.Cluster`` with 2 nodes on
this machine, each advertising the shard resource and naming itself (``KVBLEND_NODE_NAME``:
``test-node-a``, ``test-node-b``), small object stores (200 MB each), no dashboard, metrics
exported on a known port of the head. Started by the first module that asks for it, shut down
at the end of the session.

The cluster's processes live for the session; this process is its Ray driver only inside a
module that takes ``ray_cluster`` (connected at the module's start, disconnected at its end), so
the modules between them start and join Ray clusters of their own, in any order. The shards are
detached actors: they outlive a driver's disconnect, and ``shards`` finds them again per module.
"""

from __future__ import annotations

import uuid

import pytest

from cluster.workloads.services import free_port
from tests.factories import NAMESPACE

RESOURCE = "kvblend_shard"
OBJECT_STORE_BYTES = 200 * 2**20


@pytest.fixture(scope="session")
def ray_test_cluster():
    """``(cluster, metrics_port)``: the session's cluster; this process is not its driver."""
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
    yield cluster, metrics_port
    cluster.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(ray_test_cluster):
    """``(cluster, metrics_port)`` of the session's cluster, this process its driver for the
    module."""
    import ray

    cluster, _ = ray_test_cluster
    ray.init(address=cluster.address, namespace="kvblend-test-driver", log_to_driver=False)
    yield ray_test_cluster
    ray.shutdown()


@pytest.fixture(scope="session")
def kvconfig(ray_test_cluster, tmp_path_factory):
    """A KVBlendConfig for the test cluster (unique Ray namespace, tmp disk tier)."""
    from cluster.config import load_config

    cluster, _ = ray_test_cluster
    root = tmp_path_factory.mktemp("kvblend")
    return load_config(environ={}, overrides={
        "ray_address": cluster.address, "ray_namespace": f"kvblend-test-{uuid.uuid4().hex[:6]}",
        "cache_dir": str(root), "disk_path": str(root / "disk"), "host_size_gib": 0.004,
        "disk_size_gib": 0.2, "call_timeout_s": 10.0, "load_timeout_s": 10.0, "compression": "lz4"})


@pytest.fixture(scope="module")
def shards(ray_cluster, kvconfig):
    """Names of the shard actors (one per node): started by the first module, found again
    (``get_if_exists``) by the others."""
    from cluster.cache.lifecycle import start_shards

    return start_shards(kvconfig)


@pytest.fixture
def client(kvconfig, shards):
    from cluster.cache.client import CacheClient

    c = CacheClient(kvconfig, namespace=NAMESPACE)
    yield c
    c.close()


@pytest.fixture(params=["ray", "agent", "local"])
def any_client(request, kvconfig, shards):
    """The one cache client over each transport: the shard actors from this process (``ray``),
    a cache agent process on the same shards, then a machine-local fallback (``agent``, the
    connector's default), and a tier in this process (``local``)."""
    from cluster.cache.client import CacheClient
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient

    if request.param == "ray":
        c = CacheClient(kvconfig, namespace=NAMESPACE)
    elif request.param == "agent":
        c = agent_client(kvconfig, NAMESPACE, LocalCacheClient())
        assert c.transports[0].up, "the agent serves the shards"
    else:
        c = LocalCacheClient()
    yield c
    c.close()
