"""The query probe's CUDA graphs in ``kvblend bench gpu`` (issue 33): built by the vLLM
worker's own start-up function, and timed beside the eager probe.

A vLLM worker on CUDA captures every probe bucket up to ``blend.probe_graph_tokens`` when it
registers its KV caches (:func:`cluster.vllm.worker_engine.build_probe_graphs`);
:func:`build_graphs` runs that function over the bench's model before anything is timed (up to
the longest prompt of the run), so every timed blend replays the buckets a worker would.
``--probe-graphs both`` adds :func:`measure_graphs`: the gpu and hot host tiers with and without
the graphs, run by run in one process.

Functions of a :class:`cluster.bench.gpu_harness.GpuBench` (its model, device, sources and
timing helpers); only the standard library at module level.
"""

from __future__ import annotations

import statistics
import time


def _allocated(bench) -> int:
    """Bytes the caching allocator holds for live tensors (graph pools included) on the
    bench's device; 0 off CUDA. (Reserved bytes mislead here: a capture empties the cache.)"""
    if bench.device.type != "cuda":
        return 0
    bench.torch.cuda.synchronize(bench.device)
    return bench.torch.cuda.memory_allocated(bench.device)


def build_graphs(bench, scale: float, max_tokens: int):
    """``(graphs, description)``: :func:`cluster.vllm.worker_engine.build_probe_graphs` for the
    bench's first selection over prompts up to ``max_tokens``, and what it cost: ``prepare_s``,
    the buckets, ``allocated_bytes_added`` (device memory it keeps: staging, static buffers,
    the graphs' pool). ``graphs`` is None when that selection does not probe."""
    from blend.config import BlendConfig
    from cluster.vllm.worker_engine import build_probe_graphs

    before = _allocated(bench)
    graphs = build_probe_graphs(BlendConfig(selection=bench.selections[0]), bench.adapter, scale, max_tokens)
    stats = graphs.stats() if graphs is not None else {}
    return graphs, {"max_tokens": max_tokens, "allocated_bytes_added": _allocated(bench) - before,
                    "num_buckets": len(stats.get("buckets", ())), **stats}


def prepare_graphs(bench, plan) -> dict | None:
    """The probe's bucket for ``plan``: already captured by :func:`build_graphs` unless its
    rows fall in no row bucket there (captured now, before timing); a prompt whose keys exceed
    the prepared length gets none (``ready`` False: its probe runs eagerly, as in a worker).
    Returns whether it is ready, the seconds and device memory this call took, and the graphs'
    stats; None without graphs."""
    if bench.graphs is None:
        return None
    before = _allocated(bench)
    t0 = time.perf_counter()
    ok = bench.graphs.prepare_plan(plan)
    seconds = time.perf_counter() - t0
    return {"ready": ok, "prepare_s": seconds, "allocated_bytes_added": _allocated(bench) - before,
            **bench.graphs.stats()}


def measure_graphs(bench, plan, num_chunks: int, full_s: float) -> dict:
    """The gpu and hot host tiers with and without the probe's graphs, run by run alternately
    (one warm-up each), medians of ``--repeats`` with min and max, each beside ``full_s``."""
    out: dict = {}
    for tier in ("gpu", "host"):
        fns = {"off": bench._blend_fn(plan, tier, num_chunks, graphs=False),  # noqa: SLF001 - the bench's own
               "on": bench._blend_fn(plan, tier, num_chunks, graphs=True)}  # noqa: SLF001
        times: dict = {"off": [], "on": []}
        probe: dict = {"off": [], "on": []}
        replayed = {"off": 0, "on": 0}  # probe layers run from a bucket, per way
        layer_runs = (lambda: bench.graphs.layer_runs) if bench.graphs is not None else (lambda: 0)
        for fn in fns.values():
            fn()
        for _ in range(bench.args.repeats):
            for name, fn in fns.items():
                runs = layer_runs()
                bench._sync()  # noqa: SLF001
                t0 = time.perf_counter()
                res = fn()
                bench._sync()  # noqa: SLF001
                times[name].append(time.perf_counter() - t0)
                probe[name].append(res.counters.probe_s)
                replayed[name] += layer_runs() - runs
        for name, ts in times.items():
            med = statistics.median(ts)
            out[f"blend_{tier}_{name}_s"] = med
            out[f"blend_{tier}_{name}_min_s"], out[f"blend_{tier}_{name}_max_s"] = min(ts), max(ts)
            out[f"ratio_{tier}_{name}"] = med / full_s
            out[f"probe_{tier}_{name}_s"] = statistics.median(probe[name])
            out[f"replayed_layers_{tier}_{name}"] = replayed[name]
        # "on" without a prepared bucket ran the eager probe: then the two ways are the same code
        out[f"graphs_ran_{tier}"] = replayed["on"] > 0
    out["graphs"] = bench.graphs.stats() if bench.graphs is not None else None
    return out
