"""Two client processes (two replicas) see each other's chunks; Ray unreachable -> fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.factories import make_key, shard_kv

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _replica(cluster, kvconfig, *args) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.cluster.cache._replica", cluster.address,
         kvconfig.cluster.ray_namespace, *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_processes_share_chunks(ray_cluster, kvconfig, client):
    cluster, _ = ray_cluster
    # the other replica stores, this one reads
    assert _replica(cluster, kvconfig, "put", 1000, 6) == {"flushed": True}
    keys = [make_key(i) for i in range(1000, 1006)]
    assert all(m is not None for m in client.lookup(keys))
    got = client.fetch_layer(keys, 1).result(30)
    assert all(torch.equal(t, shard_kv(i)[1]) for i, t in zip(range(1000, 1006), got, strict=True))
    # this one stores, the other replica reads
    for i in range(2000, 2006):
        client.put(make_key(i), shard_kv(i))
    assert client.flush(30)
    assert _replica(cluster, kvconfig, "check", 2000, 6) == {"hits": 6, "equal": 6}


FALLBACK = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="WARN %(message)s")
from cluster.config import load_config
from cluster.cache.factory import make_client
from cluster.cache.local import LocalCacheClient
cfg = load_config(environ={}, overrides={"ray_address": sys.argv[1]})
clients = [make_client(cfg) for _ in range(3)]
assert all(isinstance(c, LocalCacheClient) for c in clients), clients
print("OK")
"""


def test_unreachable_ray_falls_back_with_one_warning():
    from cluster.workloads.services import free_port

    done = subprocess.run([sys.executable, "-c", FALLBACK, f"127.0.0.1:{free_port()}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "OK"
    warnings = [ln for ln in lines if ln.startswith("WARN")]
    assert len(warnings) == 1 and "not reachable" in warnings[0], lines
