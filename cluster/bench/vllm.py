"""``kvblend bench vllm``: TTFT through vLLM for full prefill, vLLM prefix caching and kvblend.

MuSiQue rows (../shared/data/qa/, the first N), each prompt
``PREFIX ⟨sep⟩ p1 ⟨sep⟩ ... ⟨sep⟩ p10 ⟨sep⟩ QUERY`` (the chat format of ``kvblend bench blend``),
through ``vllm.LLM`` on the CPU backend, one engine at a time, in this one run:

* ``full``        — vLLM without a connector, automatic prefix caching off;
* ``vllm_prefix`` — vLLM without a connector, automatic prefix caching on;
* ``kvblend``     — vLLM + :class:`cluster.vllm.connector.KVBlendConnector` at recompute ratio
  0.15 (``--ratio``) and the connector's selection (``--selection``), vLLM's prefix caching off (so every reuse is ours), the connector's
  defaults otherwise (blends on vLLM's async-load path); without a reachable Ray cache its
  machine-local cache is a fresh one in this run's temporary directory.

Equal warm-up: every mode first answers the same prompts with the passages in reversed order
(for ``kvblend`` this stores the passages' canonical KV; for ``vllm_prefix`` it fills vLLM's
prefix cache, which then only matches the shared system prompt), then the measured prompts
(original order). One request per measured prompt gives the answer (``--max-new-tokens``,
greedy) and its TTFT: vLLM's own ``first_token_latency`` (request arrival to its first token
in the output, the engine's log stats on); the wall time of the whole request is kept too
(``e2e_s``).

JSON per mode: ``ttft_s`` (median), ``ttft_p90_s``, ``ttft_ratio`` (median / ``full``'s median),
``agreement`` (mean token F1 of the answer vs ``full``'s), ``hit_rate`` (prompt tokens served
from a cache: vLLM's ``num_cached_tokens`` for ``vllm_prefix``, tokens claimed by the connector
for ``kvblend``), and for ``kvblend`` ``segment_hit_rate``, ``fallbacks``, ``selected_tokens``, ``selection``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

log = logging.getLogger(__name__)

MODES = ("full", "vllm_prefix", "kvblend")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", required=True, metavar="PATH", help="write results here")
    p.add_argument("--dataset", default="musique", help="musique, wikimqa or a *.norm.jsonl path")
    p.add_argument("--num-examples", type=int, default=20, help="first N rows (default 20)")
    p.add_argument("--ratio", type=float, default=0.15, help="kvblend recompute ratio (default 0.15)")
    p.add_argument("--selection", default="", help="kvblend selection (k_deviation, v_deviation, kv_deviation, "
                                                   "query_attention; default: the connector's)")
    p.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model dtype (default float32: faster than bf16 on CPUs without AMX)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-passages", type=int, default=0, help="use only the first K passages (0: all)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    # internal: run one mode in this process and write its row to --row-out
    p.add_argument("--mode-only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--row-out", default=None, help=argparse.SUPPRESS)


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    idx = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[idx]


def _prompts(tokenizer, examples, max_passages: int = 0):
    from blend.segments import build_blend_prompt
    from cluster.bench.blend import PREFIX, QUERY

    measured, warm = [], []
    for ex in examples:
        if max_passages:
            ex = dataclasses.replace(ex, passages=tuple(ex.passages)[:max_passages])
        query = QUERY.format(question=ex.question)
        measured.append(build_blend_prompt(tokenizer, PREFIX, list(ex.passages), query, add_bos=False)[0])
        warm.append(build_blend_prompt(tokenizer, PREFIX, list(ex.passages)[::-1], query, add_bos=False)[0])
    return measured, warm


def _run_mode(mode: str, model_path: str, dtype: str, measured, warm, args, stats_path: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from cluster.vllm.events import read_events
    from cluster.vllm.plugin import CONNECTOR_MODULE, CONNECTOR_NAME

    kwargs = dict(dtype=dtype, enforce_eager=True, max_model_len=8192, seed=0, disable_log_stats=False,
                  enable_prefix_caching=(mode == "vllm_prefix"))
    if mode == "kvblend":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR_NAME, kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both", kv_load_failure_policy="recompute",
            # a fresh machine-local cache (under this run's temporary directory): the measured
            # prompts hit only what this run's warm-up stored
            kv_connector_extra_config={"stats_path": stats_path, "recompute_ratios": [args.ratio],
                                       "disk_path": os.path.join(os.path.dirname(stats_path), "cache"),
                                       **({"selection": args.selection} if args.selection else {})})
    llm = LLM(model_path, **kwargs)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    answer = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0)
    try:
        for ids in warm:  # equal warm-up: the reversed orderings
            llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
        if mode == "kvblend":  # the connector stores in later engine steps: run them now
            from cluster.vllm.offline import settle

            settle(llm)
        ttfts, e2es, answers, cached, rids = [], [], [], [], []
        for ids in measured:
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], answer, use_tqdm=False)[0]
            e2es.append(time.perf_counter() - start)
            if out.metrics is None or not out.metrics.first_token_latency:
                raise RuntimeError("vLLM reported no first_token_latency (log stats off?)")
            ttfts.append(out.metrics.first_token_latency)
            cached.append((out.num_cached_tokens or 0) / len(ids))
            rids.append(out.request_id)
            answers.append(out.outputs[0].text)
    finally:
        del llm
        gc.collect()
    row = {"ttft_s": statistics.median(ttfts), "ttft_p90_s": _percentile(ttfts, 0.9),
           "e2e_s": statistics.median(e2es),
           "answers": answers, "prefix_caching": mode == "vllm_prefix"}
    if mode == "kvblend":
        ev = read_events(stats_path)
        by_id = {}
        for e in ev:
            by_id.setdefault(e["request_id"].rsplit("-", 1)[0], []).append(e)
        lookups = [next((e for e in by_id.get(r, []) if e["event"] == "lookup"), None) for r in rids]
        loads = [next((e for e in by_id.get(r, []) if e["event"] == "load"), None) for r in rids]
        segs = sum(lk["num_segments"] for lk in lookups if lk)
        hits = sum(lk["num_hit_segments"] for lk in lookups if lk)
        row.update(segment_hit_rate=hits / segs if segs else 0.0,
                   hit_rate=statistics.mean(((ld["load_end"] - ld["load_start"]) / len(ids)) if ld else 0.0
                                            for ld, ids in zip(loads, measured, strict=True)),
                   fallbacks=sum(1 for ld in loads if ld and ld.get("fallback")),
                   selected_tokens=statistics.mean(ld["selected_tokens"] for ld in loads if ld) if any(loads) else 0,
                   reused_tokens=statistics.mean(ld["reused_tokens"] for ld in loads if ld) if any(loads) else 0,
                   recompute_ratio=args.ratio,
                   selection=next((ld["selection"] for ld in loads if ld and ld.get("selection")), ""))
    else:
        row["hit_rate"] = statistics.mean(cached)
    return row


def child_main(argv: list[str]) -> int:
    """One ``--mode-only`` run in a fresh process, as :func:`run` starts one per mode: this
    module's own flags and ``kvblend``'s log format (the benchmarks import no CLI module)."""
    parser = argparse.ArgumentParser(prog="kvblend bench vllm")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(run(parser.parse_args(argv)) or 0)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        from cluster.workloads.replicas import replica_cpus

        # every engine on all of this machine's cores, as in the demo (vLLM's default binding
        # leaves one of two cores idle here: 24 s instead of 12 s for a 3.5K-token prefill)
        cpus = replica_cpus(0, 1)
        if cpus:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from cluster.config import cache_dir, load_config
    from cluster.workloads.model import resolve_model
    from cluster.workloads.qa import load_examples, resolve_dataset, token_f1

    if args.mode_only:
        # one engine in this process: vLLM's scheduler and worker then share the process-local
        # cache when no Ray cache is reachable (the same for every mode)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        model_path = resolve_model(args.model, cache_dir(load_config()))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        examples = load_examples(resolve_dataset(args.dataset), limit=args.num_examples)
        measured, warm = _prompts(tokenizer, examples, args.max_passages)
        row = _run_mode(args.mode_only, model_path, args.dtype, measured, warm, args,
                        args.row_out + ".stats.jsonl")
        with open(args.row_out, "w") as fh:
            json.dump(row, fh)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or "full" not in modes:
        raise ValueError(f"--modes={args.modes!r}: choose from {MODES}, including 'full' (the baseline)")
    model_path = resolve_model(args.model, cache_dir(load_config()))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    examples = load_examples(resolve_dataset(args.dataset), limit=args.num_examples)
    measured, warm = _prompts(tokenizer, examples, args.max_passages)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:  # one engine at a time, each in a fresh process (memory returned)
            log.info("bench vllm: mode %s (%d prompts, mean %d tokens)", mode, len(measured),
                     statistics.mean(len(p) for p in measured))
            row_out = os.path.join(tmp, f"{mode}.json")
            cmd = [sys.executable, "-c",
                   "import sys; from cluster.bench.vllm import child_main; sys.exit(child_main(sys.argv[1:]))",
                   "--json", args.json, "--dataset", args.dataset,
                   "--num-examples", str(args.num_examples), "--ratio", str(args.ratio),
                   "--selection", args.selection,
                   "--model", args.model, "--dtype", args.dtype,
                   "--max-new-tokens", str(args.max_new_tokens), "--max-passages", str(args.max_passages),
                   "--mode-only", mode, "--row-out", row_out]
            subprocess.run(cmd, check=True)
            with open(row_out) as fh:
                results[mode] = json.load(fh)
    base = results["full"]
    for row in results.values():
        row["ttft_ratio"] = row["ttft_s"] / base["ttft_s"]
        row["agreement"] = statistics.mean(token_f1(a, b) for a, b in zip(row["answers"], base["answers"], strict=True))
    out = {"dataset": args.dataset, "num_examples": len(measured), "model": args.model, "dtype": args.dtype,
           "mean_prompt_tokens": statistics.mean(len(p) for p in measured), "modes": results}
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=2)
    for mode, row in results.items():
        print(f"{mode:12s} ttft {row['ttft_s']:.3f}s  p90 {row['ttft_p90_s']:.3f}s  "
              f"ratio {row['ttft_ratio']:.2f}  agreement {row['agreement']:.2f}  hit_rate {row['hit_rate']:.2f}")
    return 0
