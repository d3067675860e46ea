"""``kvblend bench faults``: requests through vLLM with the connector while the cache fails
(issue 20). Every request must finish, with the output full prefill gives, within a stated
deadline of full prefill's TTFT.

One run on the rig of :mod:`cluster.bench.fault_rig` (Redis and S3 behind TCP proxies, one
Ray shard with host, disk, Redis and S3 tiers, one ``vllm serve`` with the connector), at the
deadlines' defaults (``lookup_timeout_s``, ``load_timeout_s``). MuSiQue rows (../shared/data/qa/),
each prompt ``PREFIX ⟨sep⟩ p1 ⟨sep⟩ ... ⟨sep⟩ pK ⟨sep⟩ QUERY`` as ``kvblend bench vllm``
builds it; each row of the table gets prompts of its own, whose passages were ingested and
then left only below host memory (shards restarted). Rows, in this order:

==================  ==========================================================================
``full``            every prompt with ``kvblend_load: false, kvblend_store: false``: vLLM's
                    own prefill, the reference output and TTFT of each prompt
``no_fault``        the passages on disk, in Redis and S3
``redis_blackhole`` only in Redis and S3; Redis's proxy black-holes (a partition)
``s3_throttled``    only in S3; its proxy delays every read :data:`cluster.bench.fault_setup.S3_DELAY_S`
``shard_sigstop``   on disk, Redis, S3; the shard process is SIGSTOPped (LMCache PR #5047)
``corrupt_objects`` every copy damaged (a layer byte flipped, a truncated object, a forged
                    header claiming 2^28 KV heads: :func:`cluster.workloads.faults.corrupted`)
``deleted_object``  the disk files unlinked while the shard's index lists them, the Redis and
                    S3 copies deleted
==================  ==========================================================================

Every row but ``full`` asks ``kvblend_recompute_ratio: 1.0`` (every reused token recomputed:
the output must equal full prefill's). Per row: ``requests``, ``failed_requests`` (an HTTP
error or no answer within :data:`cluster.bench.fault_setup.REQUEST_TIMEOUT_S`), ``wrong_outputs`` (text differs from
``full``'s for that prompt), ``ttft_p50_s``, ``ttft_p99_s`` (client-side, first streamed token),
``hit_segments``/``segments`` and ``fallbacks`` (the connector's events), the shard counters
that moved (``lookup_timeouts``, ``read_errors``, ``breaker_open`` ...), and ``within_deadline``:
``ttft_p99_s`` <= ``full``'s ``ttft_p99_s`` + ``lookup_timeout_s`` + ``load_timeout_s``.

``--soak SECONDS`` then switches faults on and off at random (:func:`soak`): the faults that
can be lifted (Redis black-holed, S3 slowed, the shard SIGSTOPped, or none), each for
:data:`PHASE_S` seconds (uniform), requests going one at a time, each a random prompt of the
bench at ratio 1.0 compared with its full-prefill output. A warm-up comes first: every prompt
once, then rounds of every soak fault for :data:`PHASE_S`'s maximum (the shard stopped for
:data:`WARMUP_STOP_S`) until a round in which no process's shared memory grew by more than
:data:`SHMEM_SETTLED_MIB` (at most :data:`WARMUP_MAX_ROUNDS`). It fills the bounded buffers a fault fills (puts held for a stopped
shard, ``MAX_PENDING_PUT_BYTES``, on top of a full host tier) and lets every process that maps
the node's Ray object store touch its pages up to the store's high-water mark: Linux counts a
shared page in the RSS of each process that touched it, and the cache agent, which maps objects
wherever the store's allocator placed them, reached the shard's 1455 MiB only after 381 s of
the 2026-12-03 soak (a baseline at 208 s read 1195 MiB). Growth after the baseline is then not
a bounded store's first filling. The RSS baseline of every process of the rig is read after
the warm-up, then the faults switch for ``SECONDS``, and the same is read at the end. Both
readings are taken at rest, :data:`SETTLE_S` after the last request (past the worker's trailing
heap trim, :mod:`cluster.heap`): a reading during a request catches the worker's heap
anywhere in that request's life (its in-use heap swings by ~0.4 GiB between loads:
``mallinfo2`` after each load of a 25-minute soak). Target (issue 20): zero failed requests,
zero wrong outputs, every process's RSS at the end <= its baseline + 10%.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time

log = logging.getLogger(__name__)

ROWS = ("no_fault", "redis_blackhole", "s3_throttled", "shard_sigstop", "corrupt_objects", "deleted_object")
#: the faults a soak switches (those that can be lifted)
SOAK_FAULTS = ("none", "redis_blackhole", "s3_throttled", "shard_sigstop")
#: seconds one phase lasts: uniform in this range
PHASE_S = (10.0, 40.0)
#: warm-up rounds (every soak fault for PHASE_S's maximum) at most
WARMUP_MAX_ROUNDS = 6
#: seconds the shard stays stopped in each warm-up round: long enough for the puts held for it
#: to reach the client's bound (MAX_PENDING_PUT_BYTES) on top of a full host tier, the object
#: store's most (in the 2026-12-03 soak two stops back to back, 71 s, raised the store's
#: high-water mark from 1394 to 1522 MiB, the host tier's 1 GiB + 512 MiB of puts; one 40-s
#: stop had not)
WARMUP_STOP_S = 120.0
#: MiB: the warm-up ends after a round in which no process's shared memory (RssShmem: the
#: Ray object-store pages it touched) grew by more than this
SHMEM_SETTLED_MIB = 8.0
#: seconds without a request before memory is read (the baseline, the end): past the worker's
#: trailing heap trim, which runs cluster.heap.MIN_INTERVAL_S (5 s) after the last trim
SETTLE_S = 7.0
#: the RSS target: end <= baseline x this
RSS_SLACK = 1.10
#: shard counters reported per row when they moved
SHARD_COUNTERS = ("lookup_timeouts", "read_errors", "breaker_open", "breaker_half_open", "breaker_closed",
                  "promotions", "write_errors", "writes_dropped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", required=True, metavar="PATH", help="write results here")
    p.add_argument("--requests", type=int, default=4, help="requests (distinct prompts) per row (default 4)")
    p.add_argument("--passages", type=int, default=3, help="passages per prompt (default 3)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    p.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                   help="then warm up and switch faults on and off at random for this long (0: no soak)")
    p.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    p.add_argument("--workdir", default="", help="logs, disk tier, events (default: a temporary directory)")


class Workload:
    """Prompts per row: ``prompts[row]`` token ids, ``passages[row]`` their passages' texts."""

    def __init__(self, tokenizer, rows: list[str], per_row: int, num_passages: int) -> None:
        from blend.segments import build_blend_prompt
        from cluster.bench.blend import PREFIX, QUERY
        from cluster.workloads.qa import load_examples, resolve_dataset

        examples = load_examples(resolve_dataset("musique"), limit=per_row * len(rows))
        if len(examples) < per_row * len(rows):
            raise ValueError(f"{per_row} requests x {len(rows)} rows need more than {len(examples)} MuSiQue rows")
        self.prompts: dict[str, list[list[int]]] = {}
        self.passages: dict[str, list[str]] = {}
        for r, row in enumerate(rows):
            exs = examples[r * per_row:(r + 1) * per_row]
            self.prompts[row] = [build_blend_prompt(tokenizer, PREFIX, list(ex.passages)[:num_passages],
                                                    QUERY.format(question=ex.question), add_bos=False)[0]
                                 for ex in exs]
            self.passages[row] = list(dict.fromkeys(p for ex in exs for p in list(ex.passages)[:num_passages]))

    def all_passages(self) -> list[str]:
        return list(dict.fromkeys(p for ps in self.passages.values() for p in ps))


def _events_since(path: str, offset: int) -> tuple[list[dict], int]:
    from cluster.vllm.events import read_events

    events = read_events(path) if os.path.exists(path) else []
    return events[offset:], len(events)


def _connector_summary(events: list[dict]) -> dict:
    lookups = [e for e in events if e.get("event") == "lookup"]
    loads = [e for e in events if e.get("event") == "load"]
    return {"segments": sum(e.get("num_segments", 0) for e in lookups),
            "hit_segments": sum(e.get("num_hit_segments", 0) for e in lookups),
            "fallbacks": sum(1 for e in loads if e.get("fallback"))}


def _counter_deltas(before: dict, after: dict) -> dict:
    def total(status, name):
        return sum(int(s.get("counters", {}).get(name, 0)) for s in status.values())

    return {n: total(after, n) - total(before, n) for n in SHARD_COUNTERS if total(after, n) != total(before, n)}


def run_row(rig, row: str, keys: list, prompts, reference, max_tokens: int) -> dict:
    """Set up ``row``'s fault on ``keys`` (its passages' chunks), send its prompts at ratio
    1.0, lift the fault; the row's JSON (see the module docstring)."""
    from cluster.bench.fault_setup import S3_DELAY_S, fault, send

    before, offset = rig.status(), len(_events_since(rig.events_path, 0)[0])
    t0 = time.perf_counter()
    with fault(rig, row, keys, s3_delay_s=S3_DELAY_S) as injected:
        out = send(rig, prompts, reference, max_tokens, {"kvblend_recompute_ratio": 1.0})
    events, _ = _events_since(rig.events_path, offset)
    out.update(_connector_summary(events), injected=injected, shard_counters=_counter_deltas(before, rig.status()),
               wall_s=time.perf_counter() - t0)
    return out


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from cluster.bench.fault_rig import FaultRig
    from cluster.bench.fault_setup import S3_DELAY_S, ingest, keys_of, place, send
    from cluster.config import cache_dir, load_config
    from cluster.workloads.model import resolve_model

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        raise ValueError(f"--rows={args.rows!r}: unknown {bad}; choose from {ROWS}")
    model_path = resolve_model(args.model, cache_dir(load_config()))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    work = Workload(tokenizer, rows, args.requests, args.passages)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvblend-faults-") as tmp, \
            FaultRig(args.workdir or tmp, model_path) as rig:
        cfg = rig.config()
        deadlines = {"lookup_timeout_s": cfg.tiers.lookup_timeout_s, "load_timeout_s": cfg.blend.load_timeout_s}
        namespace = ingest(rig, work.all_passages(), model_path)
        keys = {row: keys_of(tokenizer, namespace, work.passages[row]) for row in rows}
        tiers = rig.direct_tiers()
        rig.restart_shards(while_stopped=lambda: log.info("bench faults: removed %s", place(tiers, keys)))
        rig.start_replica()
        everything = [ids for row in rows for ids in work.prompts[row]]
        full = send(rig, everything, None, args.max_tokens, {"kvblend_load": False, "kvblend_store": False})
        if full["failed_requests"]:
            raise RuntimeError(f"{full['failed_requests']} full-prefill requests failed: no reference")
        reference, i = {}, 0
        for row in rows:
            reference[row] = full["texts"][i:i + len(work.prompts[row])]
            i += len(work.prompts[row])
        results = {"full": full}
        bound = full["ttft_p99_s"] + deadlines["lookup_timeout_s"] + deadlines["load_timeout_s"]
        for row in rows:
            log.info("bench faults: row %s (%d requests)", row, len(work.prompts[row]))
            res = run_row(rig, row, keys[row], work.prompts[row], reference[row], args.max_tokens)
            res["within_deadline"] = bool(res["ttft_p99_s"] <= bound)
            results[row] = res
        soak_result = None
        if args.soak > 0:
            pool = [(ids, reference[row][j]) for row in rows for j, ids in enumerate(work.prompts[row])]
            soak_result = soak(rig, pool, args.soak, args.max_tokens)
    for res in results.values():
        res.pop("texts", None)
    out = {"_meta": {"model": args.model, "requests_per_row": args.requests, "passages_per_prompt": args.passages,
                     "mean_prompt_tokens": statistics.mean(len(p) for p in everything),
                     "s3_delay_s": S3_DELAY_S, "elapsed_s": time.perf_counter() - started},
           "deadlines": {**deadlines, "ttft_p99_bound_s": bound}, "rows": results}
    if soak_result is not None:
        out["soak"] = soak_result
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=2)
    _print(out)
    return 0


def soak(rig, pool: list[tuple[list[int], str]], seconds: float, max_tokens: int, seed: int = 0) -> dict:
    """Warm ``rig`` up, then run the soak for ``seconds`` with ``pool`` (``(prompt ids,
    reference text)``); returns ``seconds`` (after the baseline), ``warmup_s``,
    ``warmup_shmem_growth_mib`` (per warm-up round, each process's shared-memory growth),
    ``warmup_settled`` (the last round grew none by more than :data:`SHMEM_SETTLED_MIB`),
    ``requests``, ``failed_requests``, ``wrong_outputs`` (warm-up included), ``phases`` (count
    per fault after the baseline), ``rss_mib`` and ``anon_mib`` (per process: ``[baseline, end,
    end / baseline]`` of RSS and of its private-heap part), ``timeline`` (each process's memory,
    :meth:`FaultRig.process_memory_mib`, after each warm-up round, at the baseline and after
    every phase), ``processes_unmeasured`` (seen in the first reading, missing from the
    baseline or the end) and ``rss_within_10pct`` (false when any process is unmeasured)."""
    from cluster.bench.fault_setup import S3_DELAY_S, fault, send

    rng = random.Random(seed)
    start = time.monotonic()
    totals = {"requests": 0, "failed_requests": 0, "wrong_outputs": 0}
    phases: dict[str, int] = {}

    def send_until(t_end: float) -> None:
        while time.monotonic() < t_end:
            ids, ref = rng.choice(pool)
            got = send(rig, [ids], [ref], max_tokens, {"kvblend_recompute_ratio": 1.0})
            for k in totals:
                totals[k] += got[k]

    # warm-up: every prompt once, then rounds of every fault for the longest phase until the
    # shared memory of every process stopped growing (module docstring)
    for ids, ref in pool:
        got = send(rig, [ids], [ref], max_tokens, {"kvblend_recompute_ratio": 1.0})
        for k in totals:
            totals[k] += got[k]
    timeline, rounds = [], []
    before = rig.process_memory_mib()
    first = set(before)  # the rig's processes: each must be read at the baseline and the end
    for r in range(WARMUP_MAX_ROUNDS):
        for row in SOAK_FAULTS:
            with fault(rig, "no_fault" if row == "none" else row, [], s3_delay_s=S3_DELAY_S):
                send_until(time.monotonic() + (WARMUP_STOP_S if row == "shard_sigstop" else PHASE_S[1]))
        after = rig.process_memory_mib()
        timeline.append({"t_s": round(time.monotonic() - start), "row": f"warmup-{r + 1}", "mib": _rounded(after)})
        grew = {name: round(after[name]["shmem"] - before[name]["shmem"], 1) for name in after if name in before}
        rounds.append(grew)
        before = after
        if max(grew.values(), default=0.0) <= SHMEM_SETTLED_MIB:
            break
    time.sleep(SETTLE_S)
    baseline = rig.process_memory_mib()
    warmup_s = time.monotonic() - start
    timeline.append({"t_s": round(warmup_s), "row": "baseline", "mib": _rounded(baseline)})
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        row = rng.choice(SOAK_FAULTS)
        phase_end = min(end, time.monotonic() + rng.uniform(*PHASE_S))
        phases[row] = phases.get(row, 0) + 1
        log.info("soak: %s for %.0f s (%.0f s left)", row, phase_end - time.monotonic(), end - time.monotonic())
        with fault(rig, "no_fault" if row == "none" else row, [], s3_delay_s=S3_DELAY_S):
            send_until(phase_end)
        timeline.append({"t_s": round(time.monotonic() - start), "row": row, "mib": _rounded(rig.process_memory_mib())})
    time.sleep(SETTLE_S)
    final = rig.process_memory_mib()
    rss = {name: [round(baseline[name]["rss"], 1), round(final[name]["rss"], 1),
                  round(final[name]["rss"] / baseline[name]["rss"], 3)]
           for name in baseline if name in final and baseline[name]["rss"] > 0}
    # the private heap alone (RSS less shared-memory and file pages mapped), same form
    anon = {name: [round(baseline[name]["anon"], 1), round(final[name]["anon"], 1),
                   round(final[name]["anon"] / baseline[name]["anon"], 3)]
            for name in baseline if name in final and baseline[name]["anon"] > 0}
    return {"seconds": time.monotonic() - start - warmup_s, "warmup_s": warmup_s,
            "warmup_shmem_growth_mib": rounds,
            "warmup_settled": max(rounds[-1].values(), default=0.0) <= SHMEM_SETTLED_MIB,
            **totals, "phases": phases, "rss_mib": rss, "anon_mib": anon,
            "processes_gone": sorted(set(baseline) - set(final)),
            # e.g. a shard that did not answer `kvblend status` when memory was read
            "processes_unmeasured": sorted(first - (set(baseline) & set(final))), "timeline": timeline,
            "rss_within_10pct": (all(r[2] <= RSS_SLACK for r in rss.values()) and set(baseline) <= set(final)
                                 and first <= set(baseline))}


def _rounded(mem: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {name: {k: round(v, 1) for k, v in m.items()} for name, m in mem.items()}


def _print(out: dict) -> None:
    print(f"deadlines: lookup_timeout_s={out['deadlines']['lookup_timeout_s']:g} "
          f"load_timeout_s={out['deadlines']['load_timeout_s']:g}; "
          f"bound on a fault row's TTFT p99: {out['deadlines']['ttft_p99_bound_s']:.2f} s")
    print(f"{'row':16s} {'req':>4s} {'failed':>6s} {'wrong':>5s} {'p50 s':>7s} {'p99 s':>7s} {'hits':>7s} deadline")
    for name, r in out["rows"].items():
        hits = f"{r['hit_segments']}/{r['segments']}" if "segments" in r else "-"
        ok = "-" if name == "full" else ("met" if r["within_deadline"] else "MISSED")
        print(f"{name:16s} {r['requests']:4d} {r['failed_requests']:6d} {r['wrong_outputs']:5d} "
              f"{r['ttft_p50_s']:7.3f} {r['ttft_p99_s']:7.3f} {hits:>7s} {ok}")
    if "soak" in out:
        s = out["soak"]
        print(f"soak: warm-up {s['warmup_s']:.0f} s ({len(s['warmup_shmem_growth_mib'])} rounds, shared memory "
              f"{'settled' if s['warmup_settled'] else 'NOT settled'}), then {s['seconds']:.0f} s; "
              f"{s['requests']} requests, {s['failed_requests']} failed, "
              f"{s['wrong_outputs']} wrong; RSS within +10%: {s['rss_within_10pct']}")
        for name, (b, e, r) in s["rss_mib"].items():
            a = s["anon_mib"].get(name)
            heap = f"; heap {a[0]:.0f} -> {a[1]:.0f} MiB (x{a[2]:.2f})" if a else ""
            print(f"  {name:32s} RSS {b:.0f} -> {e:.0f} MiB (x{r:.2f}){heap}")
