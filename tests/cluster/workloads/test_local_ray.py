"""LocalRay (the demo's and ``bench faults``' cluster): two private heads on one machine, each
reached through its own address whatever the machine's ``auto`` address says, and each stopped
without touching the other (the 2026-12-03 soak followed a test's head, and ``ray stop --force``
ended every cluster on the machine)."""

from __future__ import annotations

import json
import os

import pytest

from cluster.workloads.local_ray import LocalRay, ray_node_processes
from cluster.workloads.replicas import kvblend_cli

pytestmark = pytest.mark.slow

#: where Ray's ``auto`` address lives (what ``ray start --head`` without ``--temp-dir`` writes)
AUTO_ADDRESS_FILE = "/tmp/ray/ray_current_cluster"
#: a small shard: nothing is stored
SMALL = ["--no-dashboard", "--host-size-gib", "0.01", "--disk-size-gib", "0", "--object-store-gib", "0.2"]


def _auto_address() -> str | None:
    try:
        with open(AUTO_ADDRESS_FILE) as fh:
            return fh.read()
    except OSError:
        return None


def _status_shards(cluster: LocalRay) -> list[str]:
    r = kvblend_cli("status", "--json", env=cluster.env, check=False, timeout_s=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(json.loads(r.stdout)["shards"])


def test_two_private_clusters_are_reached_by_their_address_and_stopped_alone():
    before = _auto_address()
    a = LocalRay(SMALL, env={"KVBLEND_RAY_NAMESPACE": "kvblend-localray-a"})
    b = LocalRay(SMALL, env={"KVBLEND_RAY_NAMESPACE": "kvblend-localray-b"})
    try:
        a.start()
        b.start()
        assert a.address and b.address and a.address != b.address
        assert len(a.shards) == 1 and len(b.shards) == 1
        # neither head wrote the machine's `auto` address: no other process follows or joins them
        assert _auto_address() == before
        for c in (a, b):  # each reached through its own environment
            assert c.env["RAY_ADDRESS"] == c.env["KVBLEND_RAY_ADDRESS"] == c.address
            assert _status_shards(c) == c.shards
        b_procs = ray_node_processes(b.temp_dir)
        assert ray_node_processes(a.temp_dir) and b_procs
        assert not {p.pid for p in b_procs} & {p.pid for p in ray_node_processes(a.temp_dir)}

        assert a.stop() > 0
        assert ray_node_processes(a.temp_dir) == [] and not os.path.exists(a.temp_dir)
        assert all(p.is_running() for p in b_procs)  # stopping a left b alone
        assert _status_shards(b) == b.shards
    finally:
        a.stop()
        b.stop()
    assert ray_node_processes(b.temp_dir) == []
