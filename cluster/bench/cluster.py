"""``kvblend bench cluster``: shard lookup latency and client layer-read throughput, 1-3 shards.

Starts its own multi-node Ray on this machine (``ray.cluster_utils.Cluster``, one node per
shard, each advertising the shard resource, object stores of ``--object-store-gib``) and, for
1, 2 and 3 shards (one per node, nodes added one at a time), in one process:

* ``lookup_ms`` p50/p99: :meth:`CacheClient.lookup` of a 16-segment plan (16 stored chunk
  keys, random per call), i.e. one parallel call per owning shard plus header parsing;
  ``bare_ray_call_ms`` is its floor measured in the same run: a no-op actor call to every
  shard at once (Ray's own round trip).
* layer reads, reported apart for chunks owned by the shard on the driver's node
  (``same_node``) and by other nodes' shards (``cross_node``): a request reads all L layers
  of 16 chunks in order through :meth:`CacheClient.fetch_layer` after a lookup.
  ``client_gbps`` is that flow from a cold client object cache (each chunk's object is
  ``ray.get`` once: zero-copy on the same node, one transfer across nodes);
  ``client_warm_gbps`` the same with the objects already mapped.
  ``direct_gbps`` is the baseline: the same objects read layer by layer from a
  :class:`tiers.host.HostTier` in this process with :func:`tiers.reader.read_layer` (same
  checksum and copy work, no Ray, no client). ``client_ratio = client_gbps / direct_gbps``.
* the vLLM connector's default client (``agent``: Ray in a child cache agent, issue 18) against
  the in-process client, side by side: ``agent.lookup_ms`` (timed lookup by lookup alternately
  with the in-process client's ``driver_lookup_ms``), ``agent.read_gbps`` (cold reads of
  every layer, median of >= 7 passes and its range), ``agent.read_ratio`` = agent / in-process.
* the CUDA worker's path, measured on the CPU: :class:`tiers.staging.StagedSource` over
  ``CacheClient.host_layers()`` (objects mapped from a cold client cache, then staged)
  against the same source over the machine-local client of the same bytes
  (``LocalCacheClient(HostTier).host_layers()``): ``staged_ray_gbps``, ``staged_local_gbps``,
  ``staged_ratio``. That is the Ray object-store leg ``kvblend bench gpu`` (no Ray on the GPU
  machine) leaves out.

Targets (issue 5): ``client_ratio >= 0.7`` same-node; lookup p99 <= 5 ms for 16 segments and
3 shards. All nodes share this machine's cores, so "cross-node" measures Ray's object
transfer over loopback, not a network.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass

from cluster.env import configure_object_auth

NUM_SEGMENTS = 16
NAMESPACE = "b" * 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="smaller chunks, fewer repetitions (~2 min)")
    p.add_argument("--max-shards", type=int, default=3, help="largest shard count (1..3)")
    p.add_argument("--object-store-gib", type=float, default=None,
                   help="object store per node (default 0.3 quick / 0.6)")


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _shape(quick: bool) -> dict:
    # per chunk: 2 * L * T * H * D * 2 bytes (bf16): quick 2 MiB (16 layers x 128 KiB),
    # full 8 MiB (32 layers x 256 KiB)
    if quick:
        return {"num_layers": 16, "num_tokens": 64, "num_kv_heads": 8, "head_dim": 64}
    return {"num_layers": 32, "num_tokens": 64, "num_kv_heads": 8, "head_dim": 128}


def memcpy_gbps(nbytes: int = 256 << 20, reps: int = 7) -> float:
    """This machine's single-thread memcpy (``np.copyto`` of ``nbytes``, pages touched
    first), median of ``reps``, GB/s: the ceiling of one copy per byte."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def _read_all_layers(source, keys, num_layers: int) -> float:
    """Seconds to read every layer of ``keys`` as the engine does: one ``fetch_layers`` call,
    then each layer's result in order."""
    t0 = time.perf_counter()
    for layer, fut in enumerate(source.fetch_layers(keys, range(num_layers))):
        got = fut.result(60)
        if any(t is None for t in got):
            raise RuntimeError(f"layer {layer}: a chunk could not be read")
    return time.perf_counter() - t0


def _direct_all_layers(tier, keys, headers, num_layers: int) -> float:
    from tiers.codec import layer_tensor
    from tiers.reader import read_layer

    t0 = time.perf_counter()
    for layer in range(num_layers):
        for k in keys:
            h, raw = read_layer(tier, k, layer, header=headers[k])
            layer_tensor(raw, h.layer_shape, h.dtype)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class _Run:
    """What every shard count of one run shares."""

    address: str           # the Ray cluster's
    root: str              # cache_dir of the shards
    store_gib: float       # object store per node
    shape: dict            # chunk shape (:func:`_shape`)
    quick: bool
    generator: object      # torch.Generator of the chunks' random KV
    driver_node: str       # Ray node id of this process


def run(args: argparse.Namespace) -> int:
    """Start the Ray nodes, then for 1..``--max-shards`` shards (a node each) measure
    (:func:`_measure`) and print a line; write the JSON."""
    import ray
    import torch
    from ray.cluster_utils import Cluster

    quick = args.quick
    shape = _shape(quick)
    store_gib = args.object_store_gib or (0.3 if quick else 0.6)
    chunk_bytes = 2 * 2 * shape["num_layers"] * shape["num_tokens"] * shape["num_kv_heads"] * shape["head_dim"]
    max_shards = max(1, min(3, args.max_shards))
    root = tempfile.mkdtemp(prefix="kvblend-bench-cluster-")
    node_args = {"num_cpus": 1, "resources": {"kvblend_shard": 1},
                 "object_store_memory": int(store_gib * 2**30)}
    # the shards this starts sign and check chunk objects with the key this environment names
    # (~/.kvblend/object_key once `kvblend server` made one): so must this process
    configure_object_auth(dict(os.environ))
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    results = []
    try:
        ray.init(address=cluster.address, namespace="kvblend-bench", log_to_driver=False)
        bench = _Run(cluster.address, root, store_gib, shape, quick, torch.Generator().manual_seed(0),
                     ray.get_runtime_context().get_node_id())
        for num_shards in range(1, max_shards + 1):
            if num_shards > 1:
                cluster.add_node(**node_args)
                cluster.wait_for_nodes()
            row = _measure(bench, num_shards, chunk_bytes)
            results.append(row)
            print(_row_text(row), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    out = {"benchmark": "cluster", "quick": quick, "memcpy_gbps": memcpy_gbps(),
           "chunk_shape": shape, "chunk_bytes": chunk_bytes,
           "object_store_gib_per_node": store_gib, "cpu_count": os.cpu_count(), "results": results,
           "targets": {"same_node_client_ratio_min": 0.7, "lookup_p99_ms_max_3_shards": 5.0}}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


def _measure(bench: _Run, num_shards: int, chunk_bytes: int) -> dict:
    """One shard count: start the shards, store the chunks, time lookups against bare Ray
    calls and layer reads against the direct baseline, stop the shards; the result row."""
    import ray

    from cluster.cache.client import CacheClient
    from cluster.cache.lifecycle import start_shards, stop_shards
    from cluster.config import load_config

    reps = 3 if bench.quick else 5
    lookups = 200 if bench.quick else 1000
    cfg = load_config(environ={}, overrides={
        "ray_address": bench.address, "ray_namespace": f"kvblend-bench-{uuid.uuid4().hex[:6]}",
        "cache_dir": bench.root, "host_size_gib": bench.store_gib * 0.6, "disk_size_gib": 0.0,
        "call_timeout_s": 30.0, "load_timeout_s": 30.0, "metrics": False})
    names = start_shards(cfg)
    client = CacheClient(cfg, NAMESPACE)
    infos = {n: ray.get(ray.get_actor(n, namespace=cfg.cluster.ray_namespace).ready.remote())
             for n in names}
    local = {n for n, i in infos.items() if i["node_id"] == bench.driver_node}
    same, cross, direct, headers = _store_chunks(client, local, num_shards, bench.shape, bench.generator)
    handles = [ray.get_actor(n, namespace=cfg.cluster.ray_namespace) for n in names]
    lat, bare = _lookup_ms(client, same + cross, lookups), _bare_call_ms(handles, lookups)
    row = {"num_shards": num_shards, "shards": names,
           "lookup_ms": {"p50": _percentile(lat, 0.5), "p99": _percentile(lat, 0.99),
                         "num_lookups": lookups, "segments": NUM_SEGMENTS},
           "bare_ray_call_ms": {"p50": _percentile(bare, 0.5), "p99": _percentile(bare, 0.99)}}
    for label, keys in (("same_node", same), ("cross_node", cross)):
        if keys:
            row[label] = _read_gbps(client, direct, headers, keys, bench.shape["num_layers"], reps,
                                    len(keys) * chunk_bytes)
    row["agent"] = _agent_row(cfg, client, same + cross, bench.shape["num_layers"], reps,
                              len(same + cross) * chunk_bytes, max(50, lookups // 4))
    client.close()
    stop_shards(cfg.cluster.ray_namespace)
    return row


def _agent_row(cfg, client, keys: list, num_layers: int, reps: int, nbytes: int, lookups: int) -> dict:
    """The vLLM connector's client (``ray_client='agent'``: Ray in a child process, the
    product's :func:`~cluster.cache.factory.make_client` path) against the in-process
    :class:`CacheClient` in the same run: lookup latency and cold reads of every layer of
    ``keys`` (objects fetched anew each pass)."""
    from cluster.cache.factory import make_client

    agent = make_client(cfg, NAMESPACE, agent=True)
    try:
        lat_agent, lat_driver = _lookup_pair_ms(agent, client, keys, lookups)
        t_agent, t_driver = [], []
        # one untimed pass each first: the agent's arena pages are faulted in on their first use
        # (once per agent: ~1 s per 128 MiB on this VM; registered, hence resident, on CUDA)
        for c in (agent, client):
            c.drop_objects()
            c.lookup(keys)
            _read_all_layers(c, keys, num_layers)
        for _ in range(max(reps, 7)):  # medians of >= 7 passes
            agent.drop_objects()
            agent.lookup(keys)
            t_agent.append(_read_all_layers(agent, keys, num_layers))
            client.drop_objects()
            client.lookup(keys)
            t_driver.append(_read_all_layers(client, keys, num_layers))
    finally:
        agent.close()
    def gbps(ts: list[float]) -> tuple[float, list[float]]:  # median, [slowest, fastest]
        return nbytes / statistics.median(ts) / 1e9, [nbytes / max(ts) / 1e9, nbytes / min(ts) / 1e9]

    (a, a_range), (d, d_range) = gbps(t_agent), gbps(t_driver)
    return {"lookup_ms": {"p50": _percentile(lat_agent, 0.5), "p99": _percentile(lat_agent, 0.99)},
            "driver_lookup_ms": {"p50": _percentile(lat_driver, 0.5), "p99": _percentile(lat_driver, 0.99)},
            "read_gbps": a, "read_gbps_range": a_range, "driver_read_gbps": d, "driver_read_gbps_range": d_range,
            "read_ratio": a / d, "passes": len(t_agent), "num_lookups": lookups}


def _lookup_ms(client, all_keys: list, lookups: int) -> list[float]:
    """Milliseconds of each of ``lookups`` lookups of 16 random stored keys (after 10 warm-up)."""
    return _lookup_pair_ms(client, None, all_keys, lookups)[0]


def _lookup_pair_ms(first, second, all_keys: list, lookups: int) -> tuple[list[float], list[float]]:
    """:func:`_lookup_ms` of two clients side by side (``second`` None: ``first`` alone): each
    round times one lookup of each, in random order (a machine whose load drifts during the run
    weighs on both alike; timed one block after the other, the agent's ratio to the in-process
    client swung 1.3-1.9 between runs of the same code on a shared 2-core machine)."""
    clients = [c for c in (first, second) if c is not None]
    for c in clients:
        for _ in range(10):  # warm up
            c.lookup(random.sample(all_keys, NUM_SEGMENTS))
    lat: tuple[list[float], list[float]] = ([], [])
    for _ in range(lookups):
        for i in random.sample(range(len(clients)), len(clients)):
            plan = random.sample(all_keys, NUM_SEGMENTS)
            t0 = time.perf_counter()
            metas = clients[i].lookup(plan)
            lat[i].append((time.perf_counter() - t0) * 1e3)
            if any(m is None for m in metas):
                raise RuntimeError("a stored chunk was missed")
    return lat


def _bare_call_ms(handles: list, lookups: int) -> list[float]:
    """The lookups' baseline in the same run: the bare Ray round trip of a no-op call to every shard."""
    import ray

    bare = []
    for _ in range(lookups):
        t0 = time.perf_counter()
        ray.get([h.ready.remote() for h in handles], timeout=30)
        bare.append((time.perf_counter() - t0) * 1e3)
    return bare


def _read_gbps(client, direct, headers: dict, keys: list, num_layers: int, reps: int, nbytes: int) -> dict:
    """GB/s of reading every layer of ``keys`` through the client from a cold and a warm object
    cache, and directly from ``direct`` (the baseline); best of ``reps``."""
    from cluster.cache.local import LocalCacheClient
    from tiers.staging import StagedSource

    # the CUDA worker's path (tiers.staging over host_layers(); here on the CPU, no pinned
    # copies): the Ray client's mapped objects against the machine-local client over the
    # same bytes in this process (the H200 table has no Ray: this is the leg it omits)
    staged_ray = StagedSource(client.host_layers(), "cpu", pinned_bytes=0)
    staged_local = StagedSource(LocalCacheClient(direct).host_layers(), "cpu", pinned_bytes=0)
    cold, warm, base, s_ray, s_local = [], [], [], [], []
    try:
        for _ in range(reps):
            client.drop_objects()
            client.lookup(keys)  # fresh refs, as a request would
            cold.append(_read_all_layers(client, keys, num_layers))
            warm.append(_read_all_layers(client, keys, num_layers))
            base.append(_direct_all_layers(direct, keys, headers, num_layers))
            client.drop_objects()
            client.lookup(keys)
            s_ray.append(_read_all_layers(staged_ray, keys, num_layers))
            s_local.append(_read_all_layers(staged_local, keys, num_layers))
    finally:
        staged_ray.close()
        staged_local.close()
    c, w, b = nbytes / min(cold) / 1e9, nbytes / min(warm) / 1e9, nbytes / min(base) / 1e9
    sr, sl = nbytes / min(s_ray) / 1e9, nbytes / min(s_local) / 1e9
    return {"client_gbps": c, "client_warm_gbps": w, "direct_gbps": b,
            "client_ratio": c / b, "client_warm_ratio": w / b, "bytes_per_pass": nbytes,
            "staged_ray_gbps": sr, "staged_local_gbps": sl, "staged_ratio": sr / sl}


def _store_chunks(client, local: set[str], num_shards: int, shape: dict, g):
    """16 random bf16 chunks owned by a shard on the driver's node (``same``) and, with more
    than one shard, 16 owned by others (``cross``), put through the client and, encoded, into
    a :class:`tiers.host.HostTier` (``direct``) with their parsed headers."""
    import torch

    from tiers.codec import encode_kv
    from tiers.format import parse_header
    from tiers.host import HostTier
    from tiers.keys import segment_key

    same, cross, direct = [], [], HostTier(2**40)
    headers = {}
    i = 0
    while len(same) < NUM_SEGMENTS or (num_shards > 1 and len(cross) < NUM_SEGMENTS):
        key = segment_key(NAMESPACE, [num_shards, i])
        i += 1
        is_local = client.transport.router.placement.owner(str(key)) in local
        bucket = same if is_local else cross
        if len(bucket) >= NUM_SEGMENTS:
            continue
        kv = torch.randn(shape["num_layers"], 2, shape["num_tokens"], shape["num_kv_heads"],
                         shape["head_dim"], generator=g).to(torch.bfloat16)
        client.put(key, kv)
        obj = encode_kv(key, kv)
        direct.put(key, obj)
        headers[key] = parse_header(obj, expected_key=key)
        bucket.append(key)
    if not client.flush(120):
        raise RuntimeError("puts did not finish")
    return same, cross, direct, headers


def _row_text(row: dict) -> str:
    parts = [f"shards={row['num_shards']}",
             f"lookup16 p50={row['lookup_ms']['p50']:.2f}ms p99={row['lookup_ms']['p99']:.2f}ms",
             f"bare call p50={row['bare_ray_call_ms']['p50']:.2f}ms p99={row['bare_ray_call_ms']['p99']:.2f}ms"]
    for label in ("same_node", "cross_node"):
        if label in row:
            r = row[label]
            parts.append(f"{label}: client {r['client_gbps']:.2f} GB/s (warm {r['client_warm_gbps']:.2f}) "
                         f"direct {r['direct_gbps']:.2f} GB/s ratio {r['client_ratio']:.2f}; staged "
                         f"ray {r['staged_ray_gbps']:.2f} local {r['staged_local_gbps']:.2f} GB/s "
                         f"ratio {r['staged_ratio']:.2f}")
    a = row.get("agent")
    if a:
        parts.append(f"agent: lookup16 p50={a['lookup_ms']['p50']:.2f}ms (driver {a['driver_lookup_ms']['p50']:.2f}) "
                     f"read {a['read_gbps']:.2f} GB/s (driver {a['driver_read_gbps']:.2f}) ratio {a['read_ratio']:.2f}")
    return " | ".join(parts)
