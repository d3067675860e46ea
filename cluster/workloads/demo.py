"""``kvblend demo``: the main job — a RAG workload through two vLLM replicas sharing one cache.

1. Builds a workload from ../shared/data/qa/: ``--num-queries`` questions, each with
   ``--passages-per-query`` passages (its own and one shared with the next query, so queries
   overlap), in a shuffled order; about ``--holdout`` of each query's passages are never
   ingested (misses that the connector computes and stores).
2. Starts a local Ray cluster with cache shards (host + disk tiers; the host tier is sized
   smaller than the working set so the disk tier is really read) unless ``--ray-address``, in
   a thread, and at the same time the engines (:class:`_Engines`): one ``vllm serve`` without
   the connector (prefix caching on) and, once the cluster is up, two with the kvblend
   connector; an engine's start is mostly imports on one core, so they start together. The
   baseline engine answers the queries as ``full`` (every request with its own ``cache_salt``:
   nothing reused, full prefill) and then the first ``--prefix-queries`` as ``vllm_prefix``
   (vLLM's prefix cache), and stops. No kvblend request runs beside a measured baseline query.
3. Ingests the corpus (timed) and sends the same queries to the two kvblend replicas,
   alternating. Each engine first answers the same one-query warm-up (``WARMUP_PASSAGES``
   passages, all ingested, so kvblend's warm-up takes the blend path). Queries are sent one
   after another, and after each one the demo waits for that replica's stores (the canonical
   KV of the passages it missed, computed after its answer): one engine computes at a time, so
   every engine's OpenMP threads get all of this machine's cores (``--cpus``).
4. Stops the engines, and the cluster unless ``--keep`` (step ``stop``).
5. Prints a table per mode (:mod:`cluster.workloads.demo_report`: TTFT p50/p90 and ratio to
   ``full``, serving time, agreement with full prefill's answers, hit rate per tier, reused
   and recomputed tokens, gold F1), then ingest and the wall seconds and busy cores of each
   step; writes ``--json`` and a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import statistics
import threading
import time
from dataclasses import dataclass

from cluster.vllm.events import planned_stores, read_events, wait_for_stores
from cluster.workloads.demo_report import ModeResult, Steps, connector_summary, write_report
from cluster.workloads.local_ray import LocalRay
from cluster.workloads.replicas import kvblend_cli
from cluster.workloads.ttft_breakdown import ttft_breakdown

log = logging.getLogger("kvblend.demo")

MODES = ("kvblend", "full", "vllm_prefix")
#: seconds the demo waits after a kvblend query for its replica's stores (issue 36)
STORE_WAIT_S = 60.0
#: passages of the warm-up query (all ingested): enough for kvblend's warm-up to take the blend
#: path, a short prompt for every engine (a 6-passage warm-up cost ~14 s of full prefill)
WARMUP_PASSAGES = 2
#: every engine computes in its engine-core process: with V1 multiprocessing off, vLLM's CPU
#: platform keeps the uni executor, so the model worker is not a third process that imports
#: vLLM again. Three engines started together in 38 s instead of 64 s on the 2-core machine
#: (2026-12-06); the workers still bind their OpenMP threads to ``--cpus`` (full prefill's TTFT
#: is unchanged, 13.8 s). All engines alike, so the baselines are served the same way.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SYSTEM_PROMPT = ("You answer questions using the passages below. "
                 "Reply with the answer only, in at most five words.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="musique", help="musique | wikimqa | a *.norm.jsonl path")
    p.add_argument("--num-queries", type=int, default=16, help="queries sent per mode (N)")
    p.add_argument("--passages-per-query", type=int, default=6, help="passages per query (K)")
    p.add_argument("--holdout", type=float, default=0.2,
                   help="share of each query's passages never ingested (misses at serving time)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer length (greedy)")
    p.add_argument("--prefix-queries", type=int, default=4,
                   help="queries vllm_prefix answers (the first N; it only shows that vLLM's prefix cache "
                        "does not help on reordered passages; 0: all)")
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
    warmup: list[Query]         # one query sent to every engine before measuring (WARMUP_PASSAGES)


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
        if i >= num_queries:
            chosen = chosen[:WARMUP_PASSAGES]
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


def _serve_queries(mode: str, replicas, prompts, warm_prompts, max_tokens, *, salted: bool = False,
                   after_warmup=None, after_request=None) -> ModeResult:
    """Warm every replica up with ``warm_prompts`` (2 tokens each), then send ``prompts`` one at a
    time, alternating replicas. ``salted``: each request gets its own vLLM ``cache_salt``, so an
    engine with prefix caching on reuses nothing (full prefill). ``after_request()`` runs after
    each measured request and returns the seconds it waited (``ModeResult.extra["waited_s"]``,
    left out of ``serving_s``)."""
    from cluster.workloads.replicas import complete

    salt = iter(range(1 << 30))

    def send(rep, prompt, n):
        return complete(rep.url, prompt, max_tokens=n, cache_salt=f"{mode}-{next(salt)}" if salted else None)

    res = ModeResult(mode)
    for prompt in warm_prompts:
        for rep in replicas:
            send(rep, prompt, 2)
    if after_warmup is not None:
        after_warmup()
    t0 = time.perf_counter()
    waited = 0.0
    for i, prompt in enumerate(prompts):
        rep = replicas[i % len(replicas)]
        c = send(rep, prompt, max_tokens)
        res.ttft_s.append(c.ttft_s)
        res.answers.append(c.text.strip())
        res.requests.append({"id": c.id, "sent_at": c.sent_at, "ttft_s": c.ttft_s})
        log.info("[%s] q%02d via %s: TTFT %.3f s, answer %r", mode, i, rep.name, c.ttft_s, c.text.strip())
        if after_request is not None:
            waited += after_request()
    res.serving_s = time.perf_counter() - t0 - waited
    if after_request is not None:
        res.extra["waited_s"] = waited
    return res


def run(args: argparse.Namespace) -> int:
    """The demo's steps (module docstring): build the workload, start the cluster beside the
    baseline engine, run the baselines, ingest and run kvblend, stop what it started, report."""
    t_start = time.perf_counter()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r} ({', '.join(MODES)})")
    steps = Steps()
    with steps("prepare"):
        demo = _prepare(args)
    results: dict[str, ModeResult] = {}
    ray_address = args.ray_address
    cluster = None
    ingest = None
    engines = _Engines(demo)
    try:
        if "kvblend" in modes and not ray_address:
            cluster = _ClusterStart(args, demo.workdir)  # Ray and shards start beside the engines
        baselines = [m for m in ("full", "vllm_prefix") if m in modes]
        with steps("engines start"):  # every engine at once: their start is mostly one-core imports
            if baselines:
                engines.start_baseline()
            if "kvblend" in modes:
                if cluster is not None:
                    cluster.wait()
                    ray_address = cluster.ray.address
                engines.start_kvblend(ray_address)
            engines.wait_ready()
        if baselines:
            results.update(_run_baselines(baselines, demo, engines.baseline, args.max_tokens, steps))
            engines.stop_baseline()
        if "kvblend" in modes:
            results["kvblend"], ingest = _run_kvblend(args, demo, ray_address, engines, steps)
    finally:
        with steps("stop"):
            engines.stop()
            if cluster is not None:
                with contextlib.suppress(Exception):  # its error, if any, was raised above
                    cluster.wait()
                if not args.keep:
                    cluster.ray.stop()  # its own processes only
    meta = {"dataset": args.dataset, "num_queries": args.num_queries, "prefix_queries": demo.prefix_queries or None,
            "passages_per_query": args.passages_per_query,
            "mean_prompt_tokens": demo.mean_prompt_tokens, "modes": modes,
            "elapsed_s": time.perf_counter() - t_start, "steps": steps.rows,
            "gold_f1_note": "SmolLM2-135M is weak: gold F1 is noise; agreement with full prefill is the measure"}
    if ingest is not None:
        meta["ingest"] = {"passages": ingest.passages, "stored": ingest.stored, "tokens": ingest.tokens,
                          "seconds": ingest.seconds, "tokens_per_s": ingest.tokens_per_s}
    write_report(demo.json_path, demo.png_path, results, demo.golds, meta,
                 kept=cluster.ray if cluster is not None and args.keep else None)
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
    prefix_queries: int = 0   # queries vllm_prefix answers (0: all)


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
                 [q.answers for q in workload.queries], n_tokens, args.cpus or replica_cpus(0, 1),
                 max(0, args.prefix_queries))


class _Engines:
    """The demo's ``vllm serve`` engines: the baseline (no connector, prefix caching on) and the
    two kvblend replicas, started together (:meth:`wait_ready` waits for all) and bound to the
    same cores: an engine's start is mostly Python imports on one core, and serving goes one
    query at a time, so one engine computes at a time. The idle ones cost ~1% of a core."""

    def __init__(self, demo: _Demo) -> None:
        self.demo = demo
        self.baseline = None
        self.kvblend: list = []
        self.stats_path = os.path.join(demo.workdir, "connector-stats.jsonl")

    def start_baseline(self) -> None:
        from cluster.workloads.replicas import start_replica

        self.baseline = start_replica("baseline", self.demo.model_path, use_connector=False, prefix_caching=True,
                                      log_dir=self.demo.workdir, cpus=self.demo.cpus, env=ENGINE_ENV)

    def start_kvblend(self, ray_address: str) -> None:
        from cluster.workloads.replicas import start_replica

        if os.path.exists(self.stats_path):
            os.remove(self.stats_path)
        extra = {"ray_address": ray_address, "stats_path": self.stats_path}
        for c in "ab":
            self.kvblend.append(start_replica(f"kvblend-{c}", self.demo.model_path, connector_extra=extra,
                                              log_dir=self.demo.workdir, cpus=self.demo.cpus, env=ENGINE_ENV))

    def wait_ready(self) -> None:
        from cluster.workloads.replicas import wait_ready

        for rep in ([self.baseline] if self.baseline is not None else []) + self.kvblend:
            wait_ready(rep)

    def stop_baseline(self) -> None:
        if self.baseline is not None:
            self.baseline.stop()
            self.baseline = None

    def stop(self) -> None:
        self.stop_baseline()
        for rep in self.kvblend:
            rep.stop()
        self.kvblend = []


def _run_baselines(modes: list[str], demo: _Demo, rep, max_tokens: int, steps: Steps) -> dict[str, ModeResult]:
    """Step 2: the baseline engine (no connector, prefix caching on) answers the queries for
    each baseline mode: ``full`` sends every request with its own ``cache_salt`` (vLLM reuses
    nothing: full prefill), ``vllm_prefix`` without (vLLM's prefix cache), the first
    ``--prefix-queries`` only. One warm-up serves both."""
    out = {}
    warm = demo.warm_prompts
    for mode in modes:
        prompts = demo.prompts[:demo.prefix_queries or None] if mode == "vllm_prefix" else demo.prompts
        with steps(f"{mode} serving"):
            out[mode] = _serve_queries(mode, [rep], prompts, warm, max_tokens, salted=(mode == "full"))
        warm = []  # the engine is warm
    return out


class _ClusterStart:
    """Step 3's cluster, started in a thread: a private local Ray head and shards
    (:class:`cluster.workloads.local_ray.LocalRay`) on an emptied disk tier. :meth:`wait` joins
    it and raises what it raised; then :attr:`ray` has its address."""

    def __init__(self, args: argparse.Namespace, workdir: str) -> None:
        shutil.rmtree(os.path.join(workdir, "disk"), ignore_errors=True)
        argv = ["--host-size-gib", str(args.host_size_gib), "--disk-path", os.path.join(workdir, "disk")]
        if args.s3_url:
            argv += ["--s3-url", args.s3_url]
        if args.s3_endpoint_url:
            argv += ["--s3-endpoint-url", args.s3_endpoint_url]
        # the Redis URL may carry a password: through the environment, never the child's argv
        self.ray = LocalRay(argv, env={"KVBLEND_REDIS_URL": args.redis_url} if args.redis_url else None)
        self._error: BaseException | None = None
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._start, name="kvblend-demo-cluster", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self.ray.start()
            print(f"cluster: local Ray at {self.ray.address} + shards up in {time.perf_counter() - self._t0:.1f} s")
        except BaseException as e:  # noqa: BLE001 - raised again by wait()
            self._error = e

    def wait(self, timeout_s: float = 600.0) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"`kvblend server` did not finish in {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"starting the demo's cluster failed: {self._error}") from self._error


def _run_kvblend(args, demo: _Demo, ray_address: str, engines: _Engines, steps: Steps):
    """Step 3: ingest (timed) into the cluster, then the two kvblend replicas answer the queries,
    alternating. Returns ``(ModeResult, IngestReport)``."""
    import torch

    from cluster.cache.factory import make_client
    from cluster.config import load_config
    from cluster.namespace import fingerprint_cache_path, namespace_for
    from cluster.workloads.ingest import build_engine, ingest_passages
    from cluster.workloads.replicas import default_dtype

    cfg = load_config(overrides={"ray_address": ray_address})
    dtype = default_dtype()  # the replicas serve (and store KV) in this dtype
    with steps("ingest"):
        namespace = namespace_for(demo.model_path, dtype, fingerprint_cache=fingerprint_cache_path(cfg))
        engine, _ = build_engine(demo.model_path, dtype)
        client = make_client(cfg, namespace.digest())
        report = ingest_passages(demo.workload.ingest, engine, demo.tokenizer, client, namespace.digest(),
                                 kv_dtype=getattr(torch, dtype))
        del engine
    print(f"ingest: {report.stored} passages, {report.tokens} tokens in {report.seconds:.1f} s "
          f"({report.tokens_per_s:.0f} tokens/s)")
    stats_path = engines.stats_path
    reps = engines.kvblend
    try:
        mark = {}

        def stores_done() -> float:
            """The replica that answered stores its missed passages after its answer (canonical KV
            computed on its cores); the next query goes to the other replica, on the same cores
            here: wait for the stores first, so one engine computes at a time (bounded)."""
            t = time.perf_counter()
            if not wait_for_stores(stats_path, planned_stores(stats_path), timeout_s=STORE_WAIT_S):
                log.warning("stores not done within %.0f s; sending the next query anyway", STORE_WAIT_S)
            return time.perf_counter() - t

        with steps("kvblend serving"):
            res = _serve_queries("kvblend", reps, demo.prompts, demo.warm_prompts, args.max_tokens,
                                 after_warmup=lambda: (stores_done(), mark.setdefault("n", len(read_events(stats_path)))),
                                 after_request=stores_done)
    finally:
        engines.stop()
    events = read_events(stats_path)
    res.extra.update(connector_summary(events[mark.get("n", 0):]))  # keeps waited_s
    res.extra["ttft_breakdown"] = ttft_breakdown(res.requests, events)
    status = kvblend_cli("status", "--json", "--address", ray_address, check=False)
    if status.returncode == 0:
        try:
            res.extra["shards"] = json.loads(status.stdout)
        except json.JSONDecodeError:
            pass
    return res, report
