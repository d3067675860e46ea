"""``kvblend server`` (joining the test cluster), ``status``, ``clear``, ``stop`` as commands."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid

import pytest

from tests.factories import NAMESPACE, make_key, shard_kv

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def kvblend(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli.main", "--log-level", "WARNING", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def cli_namespace(ray_cluster, tmp_path_factory):
    cluster, _ = ray_cluster
    ns = f"kvblend-cli-{uuid.uuid4().hex[:6]}"
    disk = tmp_path_factory.mktemp("cli-disk")
    # the session cluster's shards run keyless (their nodes have no object key file)
    done = kvblend("server", "--address", cluster.address, "--ray-namespace", ns, "--no-object-auth",
                   "--disk-path", str(disk), "--host-size-gib", "0.004", "--disk-size-gib", "0.05",
                   "--eviction-policy", "lfu", "--engine-type", "prefix")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    yield cluster.address, ns, {**out, "disk": str(disk)}
    kvblend("stop", "--address", cluster.address, "--ray-namespace", ns)


def test_server_status_clear_stop(cli_namespace, kvconfig):
    from cluster.cache.client import CacheClient
    from cluster.cache.lifecycle import shard_names
    from cluster.config import load_config

    address, ns, started = cli_namespace
    started_disk = started["disk"]
    assert started["namespace"] == ns and len(started["shards"]) == 2
    assert sorted(shard_names(ns)) == sorted(started["shards"])

    cfg = load_config(environ={}, overrides={"ray_address": address, "ray_namespace": ns})
    client = CacheClient(cfg, NAMESPACE)
    keys = [make_key(7000 + i) for i in range(6)]
    for i, k in enumerate(keys):
        client.put(k, shard_kv(i))
    other_ns_key = make_key(7100, namespace="fedcba9876543210")
    client.put(other_ns_key, shard_kv(9))
    assert client.flush(60)

    done = kvblend("status", "--json", "--address", address, "--ray-namespace", ns)
    assert done.returncode == 0, done.stderr[-3000:]
    status = json.loads(done.stdout)
    assert sorted(status["shards"]) == sorted(started["shards"])
    total = 0
    for st in status["shards"].values():
        assert set(st["tiers"]) == {"host", "disk"}
        assert st["tiers"]["host"]["capacity_bytes"] == int(0.004 * 2**30)
        assert st["tiers"]["disk"]["capacity_bytes"] == int(0.05 * 2**30)
        total += st["tiers"]["host"]["num_chunks"]
    assert total == 7
    # each shard names its node by its stable name, which names its disk directory
    by_node = {st["node_name"]: st["disk_path"] for st in status["shards"].values()}
    assert by_node == {n: os.path.join(started_disk, f"{n}-0") for n in ("test-node-a", "test-node-b")}

    table = kvblend("status", "--address", address, "--ray-namespace", ns)
    assert table.returncode == 0
    for name in started["shards"]:
        assert name in table.stdout
    for node, path in by_node.items():
        assert node in table.stdout and f"disk {path}" in table.stdout
    assert "host" in table.stdout and "disk" in table.stdout and "evictions" in table.stdout

    done = kvblend("clear", "--namespace", NAMESPACE, "--address", address, "--ray-namespace", ns)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "deleted 12 chunk(s)" in done.stdout  # 6 keys x (host + disk)
    fresh = CacheClient(cfg, NAMESPACE)
    assert fresh.contains(keys) == [False] * 6
    assert fresh.contains([other_ns_key]) == [True]  # another namespace is untouched

    done = kvblend("stop", "--address", address, "--ray-namespace", ns)
    assert done.returncode == 0 and "stopped 2 shard(s)" in done.stdout
    deadline = time.monotonic() + 30
    while shard_names(ns) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert shard_names(ns) == []
    # reads of a stopped cache are misses, not errors
    assert fresh.lookup(keys[:2]) == [None, None]
    assert all(t is None for t in fresh.fetch_layer(keys[:2], 0).result(30))
    client.close()
    fresh.close()


def test_admin_commands_without_ray_fail_cleanly():
    from cluster.workloads.services import free_port

    done = kvblend("status", "--address", f"127.0.0.1:{free_port()}")
    assert done.returncode == 1
    assert "cannot reach Ray" in done.stderr


def test_server_rejects_a_too_small_object_store():
    done = kvblend("server", "--block", "--host-size-gib", "4", "--object-store-gib", "1")
    assert done.returncode == 2
    assert "object_store_gib=1.0 is below host_size_gib=4.0" in done.stderr
    # refused before anything was made: no object key either (issue 37)
    assert not os.path.exists(os.path.join(os.environ["HOME"], ".kvblend", "object_key"))


def test_server_starts_its_own_ray_head(tmp_path):
    """``kvblend server --address local`` runs ``ray start --head`` (in a private temp dir)
    and exits, leaving Ray and the shards running; ``status`` and ``stop`` reach them. The
    head's processes are then ended by pid (found by their private temp dir), never by name.

    Issue 37: on this fresh machine (no object key) the server creates one (mode 0600) where
    ``$KVBLEND_OBJECT_KEY_FILE`` says, prints where (never the key), and its shards sign and
    check under it; a process without the key is refused, naming where it expects it."""
    from cluster.workloads.local_ray import end_ray_node

    temp_dir = f"/tmp/kvb5-{uuid.uuid4().hex[:6]}"
    ns = "kvblend-head-test"
    key_file = tmp_path / "keys" / "object-key"
    keyed = {"KVBLEND_OBJECT_KEY_FILE": str(key_file)}
    try:
        done = kvblend("server", "--address", "local", "--temp-dir", temp_dir, "--ray-namespace", ns,
                       "--no-dashboard",
                       "--disk-path", str(tmp_path / "disk"), "--host-size-gib", "0.01",
                       "--disk-size-gib", "0.01", "--object-store-gib", "0.2",
                       timeout=180, env=keyed)
        assert done.returncode == 0, done.stderr[-3000:]
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert len(key) >= 32 and key not in done.stdout + done.stderr and str(key_file) in done.stderr
        started = json.loads(done.stdout.strip().splitlines()[-1])
        assert len(started["shards"]) == 1
        keyless = kvblend("status", "--json", "--address", started["address"], "--ray-namespace", ns)
        assert keyless.returncode == 2 and "no object key" in keyless.stderr, keyless.stderr[-3000:]
        assert os.path.join(os.environ["HOME"], ".kvblend", "object_key") in keyless.stderr
        status = kvblend("status", "--json", "--address", started["address"], "--ray-namespace", ns, env=keyed)
        assert status.returncode == 0, status.stderr[-3000:]
        assert list(json.loads(status.stdout)["shards"]) == started["shards"]
        stop = kvblend("stop", "--address", started["address"], "--ray-namespace", ns, env=keyed)
        assert stop.returncode == 0 and "stopped 1 shard(s)" in stop.stdout
    finally:
        end_ray_node(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
