"""LocalRay (the demo's and ``bench faults``' cluster): two private heads on one machine, each
reached through its own address whatever the machine's ``auto`` address says, and each stopped
without touching the other (the 2026-12-03 soak followed a test's head, and ``ray stop --force``
ended every cluster on the machine)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import psutil
import pytest

from cluster.workloads.local_ray import LocalRay, ray_node_processes, stop_hint
from cluster.workloads.replicas import kvblend_cli

pytestmark = pytest.mark.cluster

#: a small shard: nothing is stored (each head keeps its dashboard, on a port of its own)
SMALL = ["--host-size-gib", "0.01", "--disk-size-gib", "0", "--object-store-gib", "0.2"]


def _auto_address() -> str | None:
    """What Ray's ``auto`` file holds (what ``ray start --head`` without ``--temp-dir`` writes;
    this module's own RAY_TMPDIR in the suite: tests/conftest.py)."""
    from cluster.cache.connect import ray_address_file

    try:
        with open(ray_address_file()) as fh:
            return fh.read()
    except OSError:
        return None


def _status_shards(cluster: LocalRay) -> list[str]:
    r = kvblend_cli("status", "--json", env=cluster.env, check=False, timeout_s=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return sorted(json.loads(r.stdout)["shards"])


def _naming(address: str) -> dict[int, str]:
    """Every process of the machine with an argument ending in ``=address``: pid -> command."""
    assert address
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(a.endswith("=" + address) for a in p.info["cmdline"] or ()):
                out[p.pid] = " ".join(p.info["cmdline"])[:300]
    return out


def test_two_private_clusters_are_reached_by_their_address_and_stopped_alone():
    before = _auto_address()
    a = LocalRay(SMALL, env={"KVBLEND_RAY_NAMESPACE": "kvblend-localray-a"})
    b = LocalRay(SMALL, env={"KVBLEND_RAY_NAMESPACE": "kvblend-localray-b"})
    try:
        a.start()
        b.start()  # with its own dashboard while a's runs (a fixed port would refuse the start)
        assert a.address and b.address and a.address != b.address
        assert a.dashboard_url and b.dashboard_url and a.dashboard_url != b.dashboard_url
        assert len(a.shards) == 1 and len(b.shards) == 1
        # neither head wrote the machine's `auto` address: no other process follows or joins them
        assert _auto_address() == before
        for c in (a, b):  # each reached through its own environment
            assert c.env["RAY_ADDRESS"] == c.env["KVBLEND_RAY_ADDRESS"] == c.address
            assert _status_shards(c) == c.shards
        a_procs = ray_node_processes(a.temp_dir, a.address)
        b_procs = ray_node_processes(b.temp_dir, b.address)
        assert a_procs and b_procs and not {p.pid for p in a_procs} & {p.pid for p in b_procs}
        # the Ray Client server names neither the temp dir nor a parent in it: found by address
        assert set(_naming(a.address)) <= {p.pid for p in a_procs}
        assert any("ray.util.client.server" in " ".join(p.cmdline()) for p in a_procs)
        # the same without the address: the one `ray start --head` wrote in the temp dir
        assert {p.pid for p in ray_node_processes(a.temp_dir)} == {p.pid for p in a_procs}

        a_address, b_address = a.address, b.address  # stop() clears them
        assert a.stop() > 0
        assert ray_node_processes(a.temp_dir, a_address) == [] and _naming(a_address) == {}
        assert not os.path.exists(a.temp_dir)
        assert all(p.is_running() for p in b_procs)  # stopping a left b alone
        assert _status_shards(b) == b.shards

        # what `kvblend demo --keep` prints to end its cluster, run from a shell
        done = subprocess.run(["bash", "-c", stop_hint(b)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
                                   "KVBLEND_RAY_NAMESPACE": "kvblend-localray-b"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "stopped 1 shard(s)" in done.stdout
        assert ray_node_processes(b.temp_dir, b_address) == [] and _naming(b_address) == {}
        assert not os.path.exists(b.temp_dir)
    finally:
        a.stop()
        b.stop()
