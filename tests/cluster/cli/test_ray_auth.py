"""Issue 19: ``kvblend server`` on a machine without a Ray token starts a head that requires one.

A fresh machine is a fresh ``HOME`` (no ``~/.ray/auth_token``) and no ``RAY_AUTH_*`` variable:
``kvblend server`` creates the token (mode 0600, never printed), says where it is, and the
head it starts refuses what comes without it: the dashboard's job API answers 401 (200 with the
token) and ``ray start --address`` from a machine without the token does not join.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from cluster.workloads.local_ray import end_ray_node
from cluster.workloads.services import free_port

pytestmark = pytest.mark.cluster

BIN = pathlib.Path(sys.executable).parent


def _fresh_machine_env(home: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "KVBLEND_")) and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(HOME=str(home), PATH=f"{BIN}:{env.get('PATH', '')}")
    return env


def test_server_requires_a_ray_token_on_a_fresh_machine(tmp_path):
    import requests

    home, other = tmp_path / "home", tmp_path / "other"
    home.mkdir()
    other.mkdir()
    env = _fresh_machine_env(home)
    temp_dir = tempfile.mkdtemp(prefix="kvbauth-", dir="/tmp")  # short: Ray puts sockets under it
    dash = free_port()
    try:
        r = subprocess.run([str(BIN / "kvblend"), "server", "--address", "local", "--host-size-gib", "0.05",
                            "--disk-size-gib", "0", "--dashboard-port", str(dash), "--temp-dir", temp_dir],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        token_file = home / ".ray" / "auth_token"
        assert token_file.is_file() and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 16 and token not in r.stdout + r.stderr  # said where, never what
        assert str(token_file) in r.stderr and "ray start --address" in r.stderr
        address = json.loads(r.stdout.strip().splitlines()[-1])["address"]

        url = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 120  # a hang guard: the dashboard starts after the head
        while True:
            try:
                if requests.get(url + "/api/gcs_healthz", timeout=5).status_code == 200:  # a public path
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline, "the dashboard never answered"
            time.sleep(1)
        assert requests.get(url + "/api/jobs/", timeout=10).status_code == 401
        ok = requests.get(url + "/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert ok.status_code == 200, ok.text[:500]

        # another machine without the token: its node does not join
        join = subprocess.run([str(BIN / "ray"), "start", "--address", address, "--num-cpus", "0"],
                              env=_fresh_machine_env(other), capture_output=True, text=True, timeout=300)
        assert join.returncode != 0, join.stdout[-2000:]
        assert not (other / ".ray" / "auth_token").exists()
    finally:
        end_ray_node(temp_dir)  # this test's head only, never a machine-wide `ray stop`
        shutil.rmtree(temp_dir, ignore_errors=True)
