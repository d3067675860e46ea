"""``kvblend bench gpu --client agent,ray,local``: the shared cache's path onto the GPU, by client.

What a vLLM worker on a GPU runs for a request whose chunks sit in the shared cache, for each
of the clients the product builds, side by side in one run:

* ``agent``: :func:`cluster.cache.factory.make_client` with ``agent=True`` (the connector's
  default, ``ray_client: agent``): Ray in a child cache agent, objects through its
  shared-memory arena (:mod:`cluster.cache.arena`), registered with CUDA by the staging source;
* ``ray``: :class:`cluster.cache.client.CacheClient` in this process (``ray_client: driver``);
* ``local``: :class:`cluster.cache.local.LocalCacheClient` over a :class:`tiers.host.HostTier`
  in this process (the machine-local cache; no Ray, no shard).

For ``agent`` and ``ray`` the chunks are held by a real shard actor
(:func:`cluster.cache.lifecycle.start_shards`) of a one-node Ray cluster on this machine. Each
client's KV source is :func:`cluster.vllm.worker_source.build_worker_source` (the vLLM
worker's own builder) and the blend is :class:`blend.engine.BlendEngine` with the worker's
``load_timeout_s``, over :class:`cluster.bench.gpu_harness.GpuBench`'s model (Llama-3-8B
shaped, random weights, the product's fused adapter).

Rows (``tokens``, ``client``, ``state``):

* ``cold``: objects only in the shard (or the host tier) at the start of every pass: the
  client's object cache and the staging source's mapped objects are dropped first, and the
  source has no pinned store (``pinned_bytes=0``);
* ``churn``: :data:`CHURN_REQUESTS` back-to-back requests, each a different random set of
  chunks from a pool of at least 4 GiB, through a source with the product's pinned store
  (``pinned_size_gib``), nothing dropped: what a busy worker sees.

``transfer_s``: lookup plus every layer of the request's chunks on the GPU (each layer's
batch waited for on the device), synchronized. ``blend_s``: lookup plus the blend at
``--ratios``' first ratio to first-token logits. Medians with min and max over ``--repeats``
(cold) or the churn requests; ``full_s``: full prefill of the same prompt in the same run.
``h2d_gbps`` (the cold blends' copies, CUDA events) against ``h2d_baseline_gbps`` (a pinned
``copy_`` of the same per-copy bytes). Left out of the product's path: vLLM itself (its
scheduler, the connector's metadata, the paged KV cache writes), the scheduler side's lookup
process (here one process looks up and loads), and a network (one node).
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import tempfile
import time

from cluster.env import configure_object_auth

log = logging.getLogger(__name__)

CLIENTS = ("agent", "ray", "local")
#: requests of a churn row, and the least bytes of chunks they are drawn from
CHURN_REQUESTS = 24
CHURN_POOL_BYTES = 4 << 30


def _median(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def run_clients(args, lengths: list[int]) -> dict:
    """Build the model, the shard and the clients; time every length, client and state."""
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from cluster.bench.gpu_harness import NAMESPACE, GpuBench, _num_chunks
    from cluster.cache.client import CacheClient
    from cluster.cache.factory import make_client
    from cluster.cache.lifecycle import start_shards, stop_shards
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from cluster.vllm.worker_source import build_worker_source
    from tiers.host import HostTier

    device = torch.device(args.device or "cuda")
    bench = GpuBench(args, device, [max(lengths)])
    spec = bench.spec
    chunk_bytes = spec.num_layers * 2 * args.chunk_tokens * spec.num_kv_heads * spec.head_dim * 2
    pool_bytes = CHURN_POOL_BYTES if not args.tiny else 64 << 20  # --tiny: a smoke test
    pool_size = max(_num_chunks(max(lengths), args.chunk_tokens) + 1, -(-pool_bytes // chunk_bytes))
    pool = _pool(bench, pool_size)
    total = pool_size * chunk_bytes
    root = tempfile.mkdtemp(prefix="kvblend-bench-gpu-clients-")
    store = int(total * 1.3) + (2 << 30)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "resources": {"kvblend_shard": 1}, "object_store_memory": store,
        "include_dashboard": False})
    # the shards this starts sign and check chunk objects with the key this environment names
    # (~/.kvblend/object_key once `kvblend server` made one): so must this process
    configure_object_auth(dict(os.environ))
    clients: dict = {}
    try:
        ray.init(address=cluster.address, namespace="kvblend-bench", log_to_driver=False)
        overrides = {"ray_address": cluster.address, "ray_namespace": "kvblend-bench-gpu",
                     "cache_dir": root, "host_size_gib": total * 1.2 / 2**30, "disk_size_gib": 0.0,
                     "metrics": False}
        if args.arena_gib:
            overrides["agent_arena_gib"] = args.arena_gib
        cfg = load_config(environ={}, overrides=overrides)
        start_shards(cfg)
        writer = CacheClient(cfg, NAMESPACE)
        t0 = time.perf_counter()
        for i, (key, _ids, kv) in enumerate(pool):
            writer.put(key, kv)
            if i % 16 == 15 and not writer.flush(600):  # the writer drops puts past its in-flight bound
                raise RuntimeError("the shard did not store the chunks")
        stored = writer.flush(600) and all(writer.contains([k for k, _i, _kv in pool]))
        writer.close()
        if not stored:
            raise RuntimeError("the shard did not store every chunk")
        log.info("%d chunks (%.2f GB) stored in the shard in %.1f s", pool_size, total / 1e9,
                 time.perf_counter() - t0)
        local = LocalCacheClient(HostTier(int(total * 1.2)), device=device)
        for key, _ids, kv in pool:
            local.put(key, kv)
        clients = {"agent": make_client(cfg, NAMESPACE, agent=True), "ray": CacheClient(cfg, NAMESPACE),
                   "local": local}
        clients = {c: clients[c] for c in args.client}
        pinned = int(cfg.tiers.pinned_size_gib * 2**30)
        rows = []
        for length in lengths:
            rows += _length_rows(bench, cfg, clients, pool, length, pinned, build_worker_source)
        out = {"device": bench.device_name, "torch": torch.__version__, "ray": ray.__version__,
               "model": bench.model_desc, "chunk_tokens": args.chunk_tokens, "chunk_bytes": chunk_bytes,
               "ratio": bench.ratios[0], "repeats": args.repeats, "churn_requests": CHURN_REQUESTS,
               "churn_pool_bytes": total, "agent_arena_gib": cfg.cluster.agent_arena_gib,
               "load_timeout_s": cfg.blend.load_timeout_s, "pinned_size_gib": cfg.tiers.pinned_size_gib,
               "agent_stats": clients["agent"].stats() if "agent" in clients else None,
               "left_out": "vLLM (scheduler, connector metadata; its attention backend's cache update: the worker's "
                           "per-layer callback writes a paged cache of the bench's own), the scheduler "
                           "process's lookup, a network (one Ray node)", "rows": rows}
        return out
    finally:
        for name, c in clients.items():
            if name != "local":
                c.close()
        try:
            stop_shards("kvblend-bench-gpu")
        finally:
            ray.shutdown()
            cluster.shutdown()
            bench.close()


def _pool(bench, size: int) -> list:
    """``(key, token ids, kv [L, 2, T, H, D] on the CPU)`` of ``size`` chunks: the bench's own
    (read back from its host tier) and random ones beyond (churn only: timing, not quality)."""
    import torch

    from cluster.bench.gpu_harness import NAMESPACE
    from tiers.keys import segment_key

    spec, n = bench.spec, bench.args.chunk_tokens
    host = bench.sources["host"].client
    out = []
    for key, ids in zip(bench.keys, bench.chunk_ids, strict=True):
        layers = [f.result(60)[0] for f in host.fetch_layers([key], range(spec.num_layers))]
        out.append((key, ids, torch.stack([t.to("cpu") for t in layers])))
    gen = torch.Generator().manual_seed(7)
    while len(out) < size:
        ids = torch.randint(8, spec.vocab_size, (n,), generator=gen).tolist()
        kv = torch.randn(spec.num_layers, 2, n, spec.num_kv_heads, spec.head_dim, generator=gen).to(torch.bfloat16)
        out.append((segment_key(NAMESPACE, ids), ids, kv))
    return out


def _drop(client, source) -> None:
    """A cold pass: the client's object cache and the staging source's mapped objects dropped."""
    client.drop_objects()  # a cold read, as kvblend bench cluster does
    forget = getattr(getattr(source.reader, "layers", None), "forget", None)
    if forget is not None:
        forget()


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _transfer(torch, source, keys, num_layers: int, device) -> int:
    """Lookup plus every layer of ``keys`` on the GPU (each batch waited for on the device);
    the chunk-layers that missed."""
    if any(m is None for m in source.lookup(keys)):
        return len(keys) * num_layers
    missed = 0
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    for fut in source.fetch_layers(keys, range(num_layers)):
        batch = fut.result(120)
        missed += sum(t is None for t in batch)
        ready = getattr(batch, "ready", None)
        if ready is not None:
            stream.wait_event(ready)
    _sync(torch, device)
    return missed


def _length_rows(bench, cfg, clients: dict, pool: list, length: int, pinned: int, build) -> list[dict]:
    """Full prefill once, then per client a cold and a churn row at ``length``."""
    from cluster.bench.gpu_harness import _num_chunks

    num_chunks = _num_chunks(length, bench.args.chunk_tokens)
    keys = [k for k, _i, _kv in pool[:num_chunks]]
    plan, _ = bench._plan(length, bench.ratios[0])  # noqa: SLF001 - the harness's own plan
    ids = list(plan.token_ids)
    prefill = bench.BlendEngine(bench.adapter)
    full, _ = bench._timed(lambda: bench.run_prefill(prefill, ids), bench.args.repeats)  # noqa: SLF001
    rows = []
    for name, client in clients.items():
        rows.append(_cold_row(bench, cfg, name, client, keys, plan, full, build))
        log.info("%s", rows[-1])
        if length in bench.args.churn_lengths:
            rows.append(_churn_row(bench, cfg, name, client, pool, length, pinned, build, full))
            log.info("%s", rows[-1])
    return rows


def _cold_row(bench, cfg, name: str, client, keys: list, plan, full: dict, build) -> dict:
    """Transfers, then blends, each from a cold client (see the module docstring)."""
    import torch

    L = bench.spec.num_layers
    cold = build(client, bench.device, L, pinned_bytes=0)
    engine = bench.worker_engine(cold, load_timeout_s=cfg.blend.load_timeout_s)
    row = {"tokens": len(plan.token_ids), "client": name, "state": "cold", "num_chunks": len(keys),
           "full_s": full["median"], "full_min_s": full["min"], "full_max_s": full["max"]}
    missed: list[int] = []
    t, _ = bench._timed(lambda: missed.append(_transfer(torch, cold, keys, L, bench.device)),  # noqa: SLF001
                        bench.args.repeats, before=lambda: _drop(client, cold))
    row.update(transfer_s=t["median"], transfer_min_s=t["min"], transfer_max_s=t["max"],
               transfer_missed_layers=sum(missed))
    staged = bench.device.type == "cuda"  # a staging source (CPU: the client itself)
    if staged:
        cold.reader.reset_stats()
    fell_back: list[str] = []
    unfit: list[int] = []

    def blend():
        if any(m is None for m in cold.lookup(keys)):
            fell_back.append("lookup missed")
        res = bench.run_blend(engine, plan)
        unfit.append(res.counters.unfit_segments)
        if res.counters.full_prefill_reason is not None:
            fell_back.append(res.counters.full_prefill_reason)
    t, _ = bench._timed(blend, bench.args.repeats, before=lambda: _drop(client, cold))  # noqa: SLF001
    row.update(blend_s=t["median"], blend_min_s=t["min"], blend_max_s=t["max"],
               blend_unfit_segments=max(unfit, default=0),
               blend_fell_back=fell_back[:3], blend_fell_back_runs=len(fell_back),
               ratio_to_full=t["median"] / full["median"])
    if staged:
        stats = cold.reader.transfer_stats()
        per_copy = stats.num_bytes // max(1, stats.num_copies)
        row.update(h2d_gbps=stats.gbps, h2d_bytes_per_copy=per_copy, fill_bytes=stats.fill_bytes,
                   h2d_baseline_gbps=bench._h2d_baseline(per_copy, L))  # noqa: SLF001
    cold.close()
    return row


def _churn_row(bench, cfg, name: str, client, pool: list, length: int, pinned: int, build, full) -> dict:
    """:data:`CHURN_REQUESTS` transfers, then as many blends, each over a different random set
    of chunks from ``pool``, back to back through a source with the pinned store."""
    import torch

    from cluster.bench.gpu_harness import _num_chunks

    L = bench.spec.num_layers
    num_chunks = _num_chunks(length, bench.args.chunk_tokens)
    source = build(client, bench.device, L, pinned_bytes=pinned)
    engine = bench.worker_engine(source, load_timeout_s=cfg.blend.load_timeout_s)
    rng = random.Random(length)
    transfer, blend, missed, fell_back = [], [], 0, 0
    try:
        for phase in ("transfer", "blend"):
            for _ in range(CHURN_REQUESTS):
                chosen = rng.sample(pool, num_chunks)
                keys = [k for k, _i, _kv in chosen]
                _sync(torch, bench.device)
                t0 = time.perf_counter()
                if phase == "transfer":
                    missed += _transfer(torch, source, keys, L, bench.device)
                    transfer.append(time.perf_counter() - t0)
                    continue
                plan, _ = bench._plan(length, bench.ratios[0],  # noqa: SLF001
                                      chunks=(keys, [i for _k, i, _kv in chosen]))
                source.lookup(keys)
                res = bench.run_blend(engine, plan)
                _sync(torch, bench.device)
                blend.append(time.perf_counter() - t0)
                fell_back += res.counters.full_prefill_reason is not None
    finally:
        source.close()
    t, b = _median(transfer), _median(blend)
    return {"tokens": len(plan.token_ids), "client": name, "state": "churn", "num_chunks": num_chunks,
            "requests": CHURN_REQUESTS, "full_s": full["median"],
            "transfer_s": t["median"], "transfer_min_s": t["min"], "transfer_max_s": t["max"],
            "transfer_missed_layers": missed, "blend_s": b["median"], "blend_min_s": b["min"],
            "blend_max_s": b["max"], "blend_fell_back_runs": fell_back,
            "ratio_to_full": b["median"] / full["median"]}


def print_rows(out: dict) -> None:
    """The table: one line per tokens, client and state."""
    print(f"{'tokens':>6} {'client':>6} {'state':>5} {'transfer_s':>22} {'blend_s':>22} {'full_s':>7} "
          f"{'blend/full':>10} {'h2d GB/s':>13}")
    for r in out["rows"]:
        h2d = f"{r['h2d_gbps']:.1f}/{r['h2d_baseline_gbps']:.1f}" if "h2d_gbps" in r else ""
        print(f"{r['tokens']:>6} {r['client']:>6} {r['state']:>5} "
              f"{r['transfer_s']:.3f} ({r['transfer_min_s']:.3f}-{r['transfer_max_s']:.3f}) "
              f"{r['blend_s']:.3f} ({r['blend_min_s']:.3f}-{r['blend_max_s']:.3f}) {r['full_s']:7.3f} "
              f"{r['ratio_to_full']:10.2f} {h2d:>13}")
