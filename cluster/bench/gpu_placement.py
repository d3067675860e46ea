"""``kvblend bench gpu --placement``: never slower than full prefill (issue 34), by where a
request's chunks sit.

Per prompt length and placement of the request's chunks, three ways to the first token are
timed, interleaved run by run (``--repeats`` each, after warm-ups; medians with min and max):

* ``full``: full prefill (:meth:`blend.engine.BlendEngine.prefill`, what vLLM computes when the
  connector claims nothing);
* ``always_load``: lookup + the blend loading every hit (the product with ``cost_aware: false``);
* ``cost_aware``: lookup + the plan as the vLLM scheduler half prices it
  (:func:`cluster.vllm.costs.plan_with_costs` over a :class:`cluster.vllm.costs.CostEstimator`
  fed after every run by :func:`cluster.vllm.cost_samples.samples_of`, as the worker feeds it), then the
  blend of that plan, or full prefill when the plan says so.

Placements (the chunks' canonical KV computed once by :class:`cluster.bench.gpu_harness.GpuBench`):

==============  ===========================================================================
``gpu``         the worker source's gpu tier (``gpu_size_gib``)
``host_hot``    the host tier, staged from the worker's pinned store (used before)
``host_cold``   the host tier, no pinned copy (every layer filled into a pinned slot first)
``disk``        the disk tier only, page cache dropped before each run
``slow``        the host tier behind :class:`cluster.workloads.faults.ThrottledTier` at
                :data:`SLOW_GBPS` (standing in for Redis and S3, which cannot run there:
                remote memory behind a slow pipe)
``mixed``       half the chunks in the host tier (cold), half on the disk tier only, one
                :class:`tiers.stack.TierStack` (host over disk, as a shard's): the lookup
                names each chunk's tier
==============  ===========================================================================

Every source is :func:`cluster.vllm.worker_source.build_worker_source` over the machine-local
client :class:`cluster.cache.local.LocalCacheClient`. Left out of the product's path: vLLM (its
scheduler, the connector's metadata, the paged-KV writes), the shard actor and the cache
agent's hop (measured apart: ``kvblend bench gpu --client``, where the agent delivered 8K
tokens' chunks within 3% of this machine-local client on an H200 at ddefb7e, 3x slower
on an H100 at 42cb1ab and 1.45x slower there at fb340fe), and the scheduler and worker being
two processes (here one process plans and blends). Each row's ``predicted`` holds, per timed
cost-aware run, what the estimates expected of the chosen plan, of full prefill and of
always-load (seconds), beside the ``choices`` it made. The estimates are fed as the vLLM
worker feeds them: by the blends (always-load and cost-aware alike) and by
:data:`PREFILL_SEEDS` prefills of passage sizes (the canonical KV a worker computes for missed
passages) and, on a GPU, the worker's start-up prefills (:func:`cluster.vllm.cost_samples.calibration_samples`),
never by full prefills (vLLM's own); one estimator serves every placement, as one
worker's does, and :data:`WARMUP_RUNS` cost-aware runs per cell precede the timed ones.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

log = logging.getLogger(__name__)

PLACEMENTS = ("gpu", "host_hot", "host_cold", "disk", "slow", "mixed")
#: GB/s of the ``slow`` placement's throttled host tier
SLOW_GBPS = 0.3
#: GB/s of the settling run's tier before it slows tenfold and after it recovers (a host-memory
#: speed: a tier worth loading from on a GPU, so the choice has something to change)
SETTLE_GBPS = 20.0
#: cost-aware runs per cell before the timed ones (the estimates follow what they measure)
WARMUP_RUNS = 3
#: tokens of the prefills measured first: what a worker learns from computing missed passages'
#: canonical KV, passages of several lengths (vLLM's own prefills are not measured by the connector)
PREFILL_SEEDS = (128, 256, 512, 1024, 2048)


def _stats(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


class _Placements:
    """The sources of every placement and what resets each before a run."""

    def __init__(self, bench) -> None:
        from cluster.bench.gpu_ceilings import drop_page_cache
        from cluster.cache.local import LocalCacheClient
        from cluster.vllm.worker_source import build_worker_source
        from cluster.workloads.faults import ThrottledTier
        from tiers.disk import DiskTier
        from tiers.host import HostTier
        from tiers.stack import TierStack

        self.bench, self._drop = bench, drop_page_cache
        dev, L = bench.device, bench.spec.num_layers
        host_client = bench.sources["host"].client
        disk_client = bench.sources["disk"].client
        capacity = bench.disk_tier.capacity_bytes if hasattr(bench.disk_tier, "capacity_bytes") else 64 << 30
        half = len(bench.keys) // 2
        self.mixed_host_keys, self.mixed_disk_keys = bench.keys[:half], bench.keys[half:]
        # the mixed stack: its own tiers, holding the same encoded objects, split by key
        self.mixed_disk = DiskTier(bench.disk_dir + "-mixed", capacity, fsync=False)
        self.mixed_host = HostTier(capacity)
        for key in bench.keys:
            obj = bench.disk_tier.get(key)
            (self.mixed_host if key in self.mixed_host_keys else self.mixed_disk).put(key, obj)
        self.stack = TierStack([self.mixed_host, self.mixed_disk])
        self.slow_tier = ThrottledTier(host_client.tier, SLOW_GBPS, name="slow")
        clients = {"slow": LocalCacheClient(self.slow_tier, device=dev),
                   "mixed": LocalCacheClient(self.stack, device=dev)}
        self.sources = {
            "gpu": bench.sources["gpu"], "host_hot": bench.sources["host"],
            "host_cold": build_worker_source(host_client, dev, L, pinned_bytes=0),
            "disk": build_worker_source(disk_client, dev, L, pinned_bytes=0),
            "slow": build_worker_source(clients["slow"], dev, L, pinned_bytes=0),
            "mixed": build_worker_source(clients["mixed"], dev, L, pinned_bytes=0)}
        self._owned = [self.sources[p] for p in ("host_cold", "disk", "slow", "mixed")]
        self.page_cache = "kept"

    def reset(self, placement: str, keys: list) -> None:
        """Before a run: what the placement promises (no page cache under disk reads, no
        promoted copy of the mixed disk half in its host tier)."""
        bench = self.bench
        bench._sync()  # noqa: SLF001
        if placement == "disk":
            self.page_cache = self._drop([bench.disk_tier._file(k) for k in keys], bench.args.page_cache)  # noqa: SLF001
        elif placement == "mixed":
            self.mixed_host.delete([k for k in keys if k in self.mixed_disk_keys])
            self.stack._forget(keys)  # noqa: SLF001 - its header cache: read the tiers again
            self.page_cache = self._drop([self.mixed_disk._file(k) for k in keys  # noqa: SLF001
                                          if k in self.mixed_disk_keys], bench.args.page_cache)

    def close(self) -> None:
        for s in self._owned:
            s.close()


def run_placements(args, lengths: list[int], partial=None) -> dict:
    """Build the model, the chunks and the sources; time every length and placement.
    ``partial(out)`` is called with what is measured so far after each cell (a long run that
    is stopped keeps it)."""
    import torch

    from blend.cost import kv_bytes_per_token
    from cluster.bench.gpu_harness import GpuBench
    from cluster.vllm.cost_samples import calibration_samples, samples_of
    from cluster.vllm.costs import CostEstimator, linear_keys

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bench = GpuBench(args, device, [max(lengths)])
    spec = bench.spec
    hf = bench.hf_model.config
    estimator = CostEstimator(linear_keys(hf.hidden_size, spec.num_kv_heads * spec.head_dim, hf.intermediate_size))
    per_token = kv_bytes_per_token(spec, torch.finfo(bench.adapter.dtype).bits // 8)
    places = _Placements(bench)
    # the prefills a worker runs itself: canonical KV of missed passages, of various lengths
    seed = bench.BlendEngine(bench.adapter)
    flat = [t for ids in bench.chunk_ids for t in ids]
    for n in PREFILL_SEEDS:
        ids = flat[:n]
        seed.prefill(ids, want_logits=False)  # warm-up of the shape
        estimator.add(samples_of(seed.prefill(ids, want_logits=False).counters, len(ids)))
    if device.type == "cuda":  # what the worker measures once at start-up on a GPU
        estimator.add(calibration_samples(seed, spec.max_position or 0))
    rows: list[dict] = []

    def report(settle=None) -> dict:
        return {"device": bench.device_name, "torch": torch.__version__, "model": bench.model_desc,
                "chunk_tokens": args.chunk_tokens, "ratio": bench.ratios[0], "selection": bench.selections[0],
                "repeats": args.repeats, "warmup_runs": WARMUP_RUNS, "slow_gbps": SLOW_GBPS,
                "page_cache": places.page_cache, "estimates": estimator.snapshot(), "settling": settle,
                "left_out": "vLLM (scheduler, connector metadata; its attention backend's cache update: the worker's "
                            "per-layer callback writes a paged cache of the bench's own), the shard actor and the "
                            "cache agent's hop (kvblend bench gpu --client), scheduler and worker in two processes",
                "rows": rows}
    try:
        settle = _settling(bench, places, estimator, per_token, max(lengths))
        for length in lengths:
            for placement in args.placement:
                rows.append(_cell(bench, places, estimator, per_token, length, placement))
                log.info("%s", {k: v for k, v in rows[-1].items() if k not in ("choices", "predicted")})
                if partial is not None:
                    partial(report(settle))
        return report(settle)
    finally:
        places.close()
        bench.close()


def _run(bench, places, estimator, per_token: int, placement: str, plan, keys,
         way: str) -> tuple[float, str, list[float] | None]:
    """One timed request ``way`` (full / always_load / cost_aware) at ``placement``: seconds to
    first-token logits, what the plan did (``full``, ``load``, or ``recompute:<k>``) and, for a
    cost-aware request, what the estimates predicted: ``[chosen, full prefill, always-load]``
    seconds (the lookup event's ``cost`` record)."""
    from cluster.vllm.cost_samples import samples_of
    from cluster.vllm.costs import plan_with_costs

    source = places.sources[placement]
    engine = bench.worker_engine(source, load_timeout_s=60.0)
    places.reset(placement, keys)
    t0 = time.perf_counter()
    did = "full"
    if way == "full":  # vLLM's own prefill: the worker measures nothing of it
        bench.run_prefill(engine, plan.token_ids)
        bench._sync()  # noqa: SLF001
        return time.perf_counter() - t0, did, None
    metas = source.lookup(keys)
    if any(m is None for m in metas):
        raise RuntimeError(f"{placement}: the chunks were not found")
    tiers = {m.key: m.tier for m in metas}
    plan = dataclasses.replace(plan, segments=tuple(dataclasses.replace(s, tier=tiers.get(s.key, s.tier))
                                                    if s.key is not None else s for s in plan.segments))
    predicted = None
    if way == "cost_aware":
        plan, record, _ = plan_with_costs(plan, estimator, kv_bytes_per_token=per_token,
                                          num_layers=bench.spec.num_layers)
        if record is not None:
            predicted = [record["expected_s"], record["full_s"], record["always_load_s"]]
        if not plan.blend:  # vLLM computes the prompt
            bench.run_prefill(engine, plan.token_ids)
            bench._sync()  # noqa: SLF001
            return time.perf_counter() - t0, "full", predicted
    held = source.gpu_held([s.key for s in plan.hit_segments])  # as the worker asks, before its blend
    res = bench.run_blend(engine, plan)
    bench._sync()  # noqa: SLF001
    seconds = time.perf_counter() - t0
    if res.counters.full_prefill_reason is not None:
        raise RuntimeError(f"{placement}: the blend fell back: {res.counters.full_prefill_reason}")
    estimator.add(samples_of(res.counters, plan.blend_end, plan, per_token, held))
    recomputed = sum(s.recomputed for s in plan.segments)
    return seconds, f"recompute:{recomputed}" if recomputed else "load", predicted


def _cell(bench, places, estimator, per_token: int, length: int, placement: str) -> dict:
    """``full``, ``always_load`` and ``cost_aware`` interleaved run by run at one length and placement."""
    from cluster.bench.gpu_harness import _num_chunks

    plan, _ = bench._plan(length, bench.ratios[0])  # noqa: SLF001
    keys = list(bench.keys[:_num_chunks(length, bench.args.chunk_tokens)])
    if placement == "host_hot":  # pinned from its second use on
        for _ in range(2):
            _run(bench, places, estimator, per_token, placement, plan, keys, "always_load")
        pinned = getattr(places.sources[placement].reader, "pinned", None)
        if pinned is not None:
            pinned.wait_idle(120)
    ways = ("full", "always_load", "cost_aware")
    for way in ways:  # warm-up of each (compiles, pinned slots), and the estimates
        _run(bench, places, estimator, per_token, placement, plan, keys, way)
    for _ in range(WARMUP_RUNS - 1):
        _run(bench, places, estimator, per_token, placement, plan, keys, "cost_aware")
    times: dict[str, list[float]] = {w: [] for w in ways}
    choices: list[str] = []
    predicted: list[list[float] | None] = []
    for _ in range(bench.args.repeats):
        for way in ways:
            seconds, did, pred = _run(bench, places, estimator, per_token, placement, plan, keys, way)
            times[way].append(seconds)
            if way == "cost_aware":
                choices.append(did)
                predicted.append(pred)
    row = {"tokens": len(plan.token_ids), "placement": placement, "num_chunks": len(keys),
           "repeats": bench.args.repeats, "choices": choices, "predicted": predicted}
    for way in ways:
        s = _stats(times[way])
        row.update({f"{way}_s": s["median"], f"{way}_min_s": s["min"], f"{way}_max_s": s["max"]})
    best = min(row["full_s"], row["always_load_s"])
    row["cost_aware_vs_best"] = row["cost_aware_s"] / best
    return row


def _settling(bench, places, estimator, per_token: int, length: int) -> dict:
    """Requests until the cost-aware choice follows a tier that slows down tenfold, then
    recovers: the ``slow`` placement at :data:`SETTLE_GBPS`, a tenth of it, then
    :data:`SETTLE_GBPS` again. Per phase the choices and, after each request, the estimate of
    that tier's GB/s (``estimated_gbps``: how the samples moved it)."""
    from cluster.bench.gpu_harness import _num_chunks

    plan, _ = bench._plan(length, bench.ratios[0])  # noqa: SLF001
    keys = list(bench.keys[:_num_chunks(length, bench.args.chunk_tokens)])
    out = {"tokens": len(plan.token_ids)}
    tier = places.slow_tier
    try:
        for phase, gbps in (("fast", SETTLE_GBPS), ("slowed", SETTLE_GBPS / 10), ("recovered", SETTLE_GBPS)):
            tier.gbps = gbps
            seen, estimated = [], []
            for _ in range(8 if phase == "fast" else 24):
                seen.append(_run(bench, places, estimator, per_token, "slow", plan, keys, "cost_aware")[1])
                estimated.append(estimator.snapshot()["tiers"].get(tier.name, {}).get("gbps"))
                if phase != "fast" and len(seen) >= 2 and seen[-1] == seen[-2] and seen[-1] != seen[0]:
                    break
            out[phase] = {"gbps": gbps, "choices": seen, "estimated_gbps": estimated}
    finally:
        tier.gbps = SLOW_GBPS
    return out


def print_rows(out: dict) -> None:
    print(f"{'tokens':>6} {'placement':>9} {'full_s':>21} {'always_load_s':>21} {'cost_aware_s':>21} {'vs best':>7}  choices")
    for r in out["rows"]:
        cells = " ".join(f"{r[f'{w}_s']:.3f} ({r[f'{w}_min_s']:.3f}-{r[f'{w}_max_s']:.3f})"
                         for w in ("full", "always_load", "cost_aware"))
        print(f"{r['tokens']:>6} {r['placement']:>9} {cells} {r['cost_aware_vs_best']:7.2f}  "
              f"{','.join(sorted(set(r['choices'])))}")
