"""Eviction and corruption on live shards, then Ray's Prometheus endpoints: every kvblend
metric the Grafana dashboard queries is emitted, with plausible values."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

import pytest
import torch

from tests.factories import make_key, shard_kv

pytestmark = pytest.mark.cluster

GRAFANA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "cluster", "grafana", "kvblend.json")


def _scrape_all() -> str:
    import ray

    bodies = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            bodies.append(urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError:
            pass
    return "\n".join(bodies)


def _series(body: str) -> dict[str, float]:
    """Sum of samples per metric name (kvblend ones only)."""
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("#") or "kvblend" not in line:
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


def grafana_metric_names() -> set[str]:
    with open(GRAFANA) as fh:
        dash = json.load(fh)
    names = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            names.update(re.findall(r"\bray_kvblend_[a-z_]+", target["expr"]))
    return names


def test_grafana_queries_only_known_metrics():
    from cluster.cache.metrics import prometheus_names

    names = grafana_metric_names()
    assert len(names) >= 10
    assert names <= prometheus_names(), names - prometheus_names()


@pytest.fixture(scope="module")
def mclient(kvconfig, shards):
    from cluster.cache.client import CacheClient

    c = CacheClient(kvconfig)
    yield c
    c.close()


@pytest.fixture(scope="module")
def evicted_and_corrupted(mclient, kvconfig, shards):
    """Fill the 4 MiB host tiers with 1 MiB chunks (evictions) and corrupt one evicted chunk's
    disk file. Returns (keys, kvs, corrupted key)."""
    import ray

    from cluster.cache.lifecycle import get_shard

    client = mclient
    keys = [make_key(8000 + i) for i in range(14)]
    kvs = [shard_kv(8000 + i, num_tokens=256, num_kv_heads=4, head_dim=64) for i in range(14)]  # 1 MiB
    for k, kv in zip(keys, kvs, strict=True):
        client.put(k, kv)
    assert client.flush(60)
    ns = kvconfig.cluster.ray_namespace
    evicted = {}
    for name in shards:
        h = get_shard(name, ns)
        mine = [k for k in keys if client.transport.router.placement.owner(str(k)) == name]
        found = ray.get(h.lookup.remote([str(k) for k in mine], False))
        evicted[name] = [k for k, f in zip(mine, found, strict=True) if f is not None and f[0] == "disk"]
    victim_shard = max(evicted, key=lambda n: len(evicted[n]))
    assert len(evicted[victim_shard]) >= 2, evicted
    bad = evicted[victim_shard][0]
    info = ray.get(get_shard(victim_shard, ns).ready.remote())
    path = os.path.join(info["disk_path"], bad.content[:2], f"{bad.namespace}.{bad.kind}.{bad.content}.kvbc")
    with open(path, "r+b") as fh:
        fh.seek(-100, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return keys, kvs, bad, evicted[victim_shard][1]


def test_evicted_chunks_come_back_from_disk_and_corruption_is_a_miss(mclient, evicted_and_corrupted):
    client = mclient
    keys, kvs, bad, good = evicted_and_corrupted
    client._meta.clear()
    client.drop_objects()
    before = client.stats()
    errors_before = sum(s["counters"]["read_errors"] for s in before["shards"].values())
    got = client.fetch_layer([good, bad], 3).result(60)
    assert torch.equal(got[0], kvs[keys.index(good)][3])
    assert got[1] is None  # corrupted payload: a miss, not wrong bytes or an exception
    after = client.stats()
    assert sum(s["counters"]["read_errors"] for s in after["shards"].values()) > errors_before
    assert sum(s["tiers"]["host"]["evictions"] for s in after["shards"].values()) >= 2


def test_metrics_scraped_with_plausible_values(mclient, evicted_and_corrupted):
    client = mclient
    keys, _, _, _ = evicted_and_corrupted
    client._meta.clear()
    client.drop_objects()
    client.lookup(keys + [make_key(99999)])  # hits, a miss, and prefetch of evicted chunks
    time.sleep(1.0)
    client.fetch_layer(keys, 0).result(60)  # get latency, prefetch hits
    wanted = grafana_metric_names()
    deadline = time.monotonic() + 60
    series: dict[str, float] = {}
    while time.monotonic() < deadline:
        series = _series(_scrape_all())
        if wanted <= set(series):
            break
        time.sleep(2)
    assert wanted <= set(series), f"not emitted: {sorted(wanted - set(series))}"
    assert series["ray_kvblend_hits_total"] >= len(keys) - 1
    assert series["ray_kvblend_misses_total"] >= 1
    assert series["ray_kvblend_evictions_total"] >= 2
    assert series["ray_kvblend_read_errors_total"] >= 1
    assert series["ray_kvblend_bytes_in_total"] >= 14 * 2**20  # 14 chunks of 1 MiB into host
    assert 0 < series["ray_kvblend_bytes_used"] <= series["ray_kvblend_capacity_bytes"]
    assert series["ray_kvblend_lookup_latency_ms_count"] >= 1
