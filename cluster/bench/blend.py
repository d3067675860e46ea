"""``kvblend bench blend``: CacheBlend quality and TTFT against full prefill, on a real QA set.

Per example (rows of ../shared/data/qa/, MuSiQue by default, the first N):

1. every passage's canonical KV (the passage alone at 0..n-1, no BOS) is computed and put
   into the tiers (host + disk under a :class:`~cluster.cache.local.LocalCacheClient`), which
   the engine reads through the vLLM worker's source
   (:func:`cluster.vllm.worker_source.build_worker_source`: staged through pinned memory with
   ``--device cuda``);
2. the prompt ``PREFIX ⟨sep⟩ p1 ⟨sep⟩ ... ⟨sep⟩ p10 ⟨sep⟩ QUERY`` (see :data:`PREFIX`,
   :data:`QUERY`: the model's chat format, answer within 5 words) is answered by
   (a) ``full``: the HF model's own forward with SDPA (the fastest full prefill here) and
   (b) ``blend_<ratio>``: plan (one batched lookup) + :meth:`BlendEngine.blend` reading KV
   through the tiers, both timed from token ids to the first token's logits (synchronized on
   a GPU), same device, dtype and thread count, after a warm-up;
3. the answer is decoded greedily (``max_new_tokens`` 16) from each mode's KV by the same HF
   decode loop, and scored.

Modes: ``full``; ``reuse`` (ratio 0: nothing recomputed, one shared row, the same in every
selection); ``recompute_all`` (ratio 1.0, shared likewise); and ``<selection>@<ratio>`` for
every ``--selection`` (:data:`blend.config.SELECTIONS`) and every other ratio; with
``--variant NAME KEY=VALUE ...`` each query-aware selection runs once per variant instead,
as ``<selection>+NAME@<ratio>`` (:mod:`cluster.bench.blend_modes`).

JSON: per dataset, one object per mode with ``ttft_s`` (median), ``ttft_ratio`` (median blend
/ median full), ``probe_share`` (median share of TTFT spent in the query-attention probe),
``f1`` (max over gold answers, SQuAD normalization; with SmolLM2-135M it is noise),
``agreement`` (token F1 vs the full-prefill answer) and its bootstrap 90% interval,
``first_token_match``, ``kl_first`` (mean KL(p_full || p_blend) of the first token),
``nll_self`` (mean per-token NLL of the full-prefill answer teacher-forced on the mode's KV),
``gap_recovered`` ((NLL_reuse - NLL_mode) / (NLL_reuse - NLL_full), NLL_reuse from the
shared ``reuse`` row, ratio of means), ``nll_gold``, ``recomputed_tokens`` (rows computed in
the top layer), ``reused_tokens``. A PNG of gap recovered and agreement against the TTFT
ratio, a line per selection and a panel per dataset, sits beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

from cluster.bench import blend_report as report
from cluster.bench.blend_modes import (
    VARIANT_FIELDS,
    Mode,
    float_list,
    int_tuple,
    load_rows,
    modes_of,
    parse_rows,
    parse_variant,
)

log = logging.getLogger(__name__)

PREFIX = ("<|im_start|>system\nYou will be asked a question after reading several passages. "
          "Answer the question based on the given passages. Do not repeat the question. "
          "The answer should be within 5 words.<|im_end|>\n<|im_start|>user\nPassages:")
QUERY = "Question: {question}\nAnswer within 5 words.<|im_end|>\n<|im_start|>assistant\n"
DEFAULT_RATIOS = "0,0.05,0.15,0.3,1.0"
#: Seconds between checkpoints of the JSON during a dataset (the rows so far, summarized).
CHECKPOINT_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", required=True, metavar="PATH", help="write results here (a PNG goes beside it)")
    p.add_argument("--dataset", default="musique",
                   help="musique, wikimqa or a *.norm.jsonl path; comma-separated for several (a table each)")
    p.add_argument("--num-examples", type=int, default=20, help="first N rows (default 20; --rows instead)")
    p.add_argument("--rows", default="", metavar="A:B",
                   help="rows A..B-1 of each dataset (0-based, as Python slices; e.g. 20:150 to tune on "
                        "MuSiQue, 20:102 to report on 2WikiMQA); overrides --num-examples")
    p.add_argument("--ratios", default=DEFAULT_RATIOS, help=f"recompute ratios (default {DEFAULT_RATIOS})")
    p.add_argument("--check-layers", default="1", help="0-based check layers, comma-separated (default 1)")
    p.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model and KV dtype")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both modes (0: torch default)")
    p.add_argument("--max-passages", type=int, default=0, help="use only the first K passages (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--selection", default="k_deviation,query_attention",
                   help="selections to compare, comma-separated (k_deviation, v_deviation, kv_deviation, "
                        "query_attention, query_k_deviation; default k_deviation,query_attention)")
    p.add_argument("--probe-layers", default="", help="query_attention: probe layers (default: the engine's)")
    p.add_argument("--sink-tokens", type=int, default=None, help="query_attention: sink tokens per chunk "
                                                                "(default: the blend config's)")
    p.add_argument("--variant", nargs="+", action="append", metavar="NAME KEY=VALUE",
                   help="run every query-aware selection once per variant (instead of once), as <selection>+NAME@<ratio>, with these blend-config "
                        f"values ({', '.join(VARIANT_FIELDS)}; e.g. --variant cb1 chunk_budget_power=1); repeatable")
    p.add_argument("--separator", default=None, help="segment separator (default: blend config's)")
    p.add_argument("--plot", default="", metavar="PNG", help="only draw this PNG from --json (a machine "
                   "without matplotlib writes the JSON alone)")
    p.add_argument("--device", default="cpu", help="torch device of the model and the blend (default cpu; "
                   "cuda reads the tiers through the worker's staged source)")


def run(args: argparse.Namespace) -> int:
    """The benchmark: set up once, then per dataset and example store its passages, time and
    decode full prefill, time and decode each mode; write the JSON, the PNG and a table each."""
    if args.plot:
        return _replot(args.json, args.plot)
    import torch
    from tqdm import tqdm

    from blend.config import parse_selections

    ratios = float_list(args.ratios, "ratios")
    check_layers = tuple(int(x) for x in float_list(args.check_layers, "check-layers"))
    if any(not 0 <= r <= 1 for r in ratios):
        raise ValueError(f"--ratios={args.ratios!r}: each ratio must be in [0, 1]")
    selections = parse_selections(args.selection)
    if args.num_examples <= 0:
        raise ValueError(f"--num-examples={args.num_examples} must be positive")
    if args.rows:
        parse_rows(args.rows)  # a malformed slice fails before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = modes_of(ratios, selections, [parse_variant(v) for v in args.variant or ()])
    bench = _Bench(args, check_layers)
    summaries: dict[str, dict] = {}
    warmed, last_write = False, time.monotonic()
    for dataset in [x.strip() for x in args.dataset.split(",") if x.strip()]:
        rows: list[dict] = []
        for ex in tqdm(bench.load(dataset), desc=f"bench blend {dataset}", unit="example"):
            passages = list(ex.passages[:args.max_passages] if args.max_passages else ex.passages)
            bench.store_passages(passages)
            ids, spans = bench.prompt(passages, ex.question)
            if not warmed:  # warm-up, excluded: allocator, thread pools, first-call paths
                bench.full_forward(ids[:256])
                for mode in modes:  # every selection and variant: first-call paths per shape
                    if mode.name not in ("reuse", "recompute_all"):
                        bench.engine.blend(bench.plan_for(ids, spans, mode.ratio, mode.selection, mode.overrides))
                warmed = True
            row, full = bench.full_mode(ex, ids)
            for mode in modes:
                row[mode.name] = bench.blend_mode(ex, ids, spans, mode, full)
            rows.append(row)
            if time.monotonic() - last_write >= CHECKPOINT_S:  # a run killed by a timeout keeps its rows
                summaries[dataset] = _summary(args, bench, dataset, rows, modes, check_layers)
                checkpoint(args.json, summaries)
                last_write = time.monotonic()
        summaries[dataset] = _summary(args, bench, dataset, rows, modes, check_layers)
        report.print_table(summaries[dataset], modes)
        _write(args, summaries, modes, selections)  # after each dataset: a long run keeps what it measured
    bench.close()
    return 0


@dataclass(frozen=True)
class _Full:
    """Full prefill's answer of one example, what each blend mode is compared with.

    Attributes:
        answer: its greedy answer's token ids; text: decoded.
        p_full: ``[V]`` float32 first-token probabilities.
        gold: the first gold answer's token ids and ``<|im_end|>`` (empty without answers).
    """

    answer: list[int]
    text: str
    p_full: object
    gold: list[int]


class _Bench:
    """The model, tokenizer, tiers and blend engine of one run, and the timed modes."""

    def __init__(self, args: argparse.Namespace, check_layers: tuple[int, ...]) -> None:
        import torch
        from transformers import AutoTokenizer

        from blend.adapters.hf import HFModelAdapter
        from blend.engine import BlendEngine
        from cluster.cache.local import LocalCacheClient
        from cluster.config import cache_dir, load_config
        from cluster.namespace import fingerprint_cache_path, namespace_for
        from cluster.vllm.worker_source import build_worker_source
        from cluster.workloads.model import resolve_model

        self.torch, self.args, self.check_layers = torch, args, check_layers
        self.device = torch.device(args.device)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        config = load_config(environ=dict(os.environ))
        self.path = resolve_model(args.model, cache_dir(config))
        self.separator = args.separator or config.blend.blend_separator
        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.adapter = HFModelAdapter.from_pretrained(self.path, dtype=dtype)
        self.model = self.adapter.model.to(self.device)
        self.namespace = namespace_for(self.path, args.dtype, fingerprint_cache=fingerprint_cache_path(config)).digest()
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eos_ids = {i for i in (tokenizer.eos_token_id, self.im_end) if i is not None}
        self._tmp = tempfile.TemporaryDirectory(prefix="kvblend-bench-")
        self.tier, self.tiers_used = _make_tier(self._tmp.name)
        self.client = LocalCacheClient(self.tier, device=self.device)
        self.source = build_worker_source(self.client, self.device, self.adapter.spec.num_layers)
        self.engine = BlendEngine(self.adapter, self.source)
        self.config = config.blend

    def load(self, dataset: str) -> list:
        """The examples of ``dataset`` this run measures (:func:`load_rows`)."""
        return load_rows(dataset, self.args.rows, self.args.num_examples)

    def close(self) -> None:
        self.source.close()
        _close(self.tier)
        self._tmp.cleanup()

    def plan_for(self, ids, spans, ratio: float, selection: str, overrides: tuple = ()):
        """The planner's plan, as the connector makes it, for one mode (``overrides``: a
        variant's ``(field, value)`` pairs over the run's config)."""
        import dataclasses

        from blend.planner import make_plan

        probe = int_tuple(self.args.probe_layers, "probe-layers") if self.args.probe_layers else self.config.probe_layers
        sinks = self.config.sink_tokens if self.args.sink_tokens is None else self.args.sink_tokens
        cfg = dataclasses.replace(self.config, blend_separator=self.separator, check_layers=self.check_layers,
                                  recompute_ratios=(ratio,), recompute_thresholds=(), min_tokens=0,
                                  selection=selection, probe_layers=probe, sink_tokens=sinks)
        cfg = dataclasses.replace(cfg, **dict(overrides))
        return make_plan(ids, spans, self.namespace, self.source, cfg, query_to_engine=True)

    def sync(self) -> None:
        """Wait for the device (a no-op on the CPU): timings end when the work has."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def full_forward(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids], device=self.device), use_cache=True)
        return out

    def store_passages(self, passages: list[str]) -> None:
        """Every passage's canonical KV into the tiers."""
        from blend.segments import chunk_token_ids
        from tiers.keys import segment_key

        for text in passages:
            ids = chunk_token_ids(self.tokenizer, text)
            kv = self.torch.stack(self.engine.prefill(ids, want_logits=False).kv)  # [L, 2, T, H, D]
            self.client.put(segment_key(self.namespace, ids), kv)
        self.client.flush()

    def prompt(self, passages: list[str], question: str):
        """``PREFIX ⟨sep⟩ p1 ⟨sep⟩ ... ⟨sep⟩ QUERY`` as token ids and segment spans."""
        from blend.segments import build_blend_prompt

        return build_blend_prompt(self.tokenizer, PREFIX, passages, QUERY.format(question=question),
                                  separator=self.separator, add_bos=False)

    def full_mode(self, ex, ids: list[int]) -> tuple[dict, _Full]:
        """The example's row with its ``full`` entry (HF forward timed to the first logits),
        and full prefill's answer."""
        from blend.segments import chunk_token_ids
        from cluster.workloads.qa import max_f1

        torch, model, tokenizer = self.torch, self.model, self.tokenizer
        self.sync()
        t0 = time.perf_counter()
        out = self.full_forward(ids)
        full_logits = out.logits[0, -1].float()
        self.sync()
        ttft_full = time.perf_counter() - t0
        cache = out.past_key_values
        full_kv = [torch.stack((cache.layers[i].keys[0].transpose(0, 1), cache.layers[i].values[0].transpose(0, 1)))
                   for i in range(self.adapter.spec.num_layers)]
        del out
        full_answer = report.decode_greedy(model, full_kv, full_logits, self.args.max_new_tokens, self.eos_ids, torch)
        full_text = tokenizer.decode(full_answer, skip_special_tokens=True).strip()
        gold = chunk_token_ids(tokenizer, ex.answers[0]) + [self.im_end] if ex.answers else []
        row = {"id": ex.id, "num_tokens": len(ids), "full": {
            "ttft_s": ttft_full, "probe_share": 0.0, "answer": full_text, "f1": max_f1(full_text, ex.answers),
            "agreement": 1.0, "first_token_match": 1.0, "kl_first": 0.0,
            "nll_self": report.answer_nll(model, full_kv, full_logits, full_answer, torch),
            "nll_gold": report.answer_nll(model, full_kv, full_logits, gold, torch),
            "recomputed_tokens": len(ids), "reused_tokens": 0}}
        return row, _Full(full_answer, full_text, torch.softmax(full_logits, -1), gold)

    def blend_mode(self, ex, ids: list[int], spans, mode: Mode, full: _Full) -> dict:
        """One blend mode's entry: plan + blend timed to the first logits, decoded, compared."""
        from cluster.workloads.qa import max_f1, token_f1

        torch, model = self.torch, self.model
        self.sync()
        t0 = time.perf_counter()
        plan = self.plan_for(ids, spans, mode.ratio, mode.selection, mode.overrides)
        res = self.engine.blend(plan)
        self.sync()
        ttft = time.perf_counter() - t0
        answer = report.decode_greedy(model, res.kv, res.logits, self.args.max_new_tokens, self.eos_ids, torch)
        text = self.tokenizer.decode(answer, skip_special_tokens=True).strip()
        p_full = full.p_full
        log_p_blend = torch.log_softmax(res.logits.float(), -1)
        return {
            "ttft_s": ttft, "probe_share": res.counters.probe_s / ttft, "answer": text,
            "f1": max_f1(text, ex.answers), "agreement": token_f1(text, full.text),
            "first_token_match": float(answer[0] == full.answer[0]),
            "kl_first": float((p_full * (torch.log(p_full.clamp_min(1e-30)) - log_p_blend)).sum()),
            "nll_self": report.answer_nll(model, res.kv, res.logits, full.answer, torch),
            "nll_gold": report.answer_nll(model, res.kv, res.logits, full.gold, torch),
            "recomputed_tokens": int(res.recompute_idx.numel()),
            "reused_tokens": res.counters.reused_tokens,
            "selection": res.counters.selection,
            "load_wait_s": res.counters.load_wait_s,
            "full_prefill_reason": res.counters.full_prefill_reason}


def _summary(args: argparse.Namespace, bench: _Bench, dataset: str, rows: list[dict], modes: list[Mode],
             check_layers: tuple[int, ...]) -> dict:
    """One dataset's summary (per mode, see the module docstring), its meta and its rows."""
    summary = report.summarize(rows, [m.name for m in modes])
    summary["meta"] = {
        "dataset": dataset, "num_examples": len(rows), "rows": args.rows or f"0:{len(rows)}", "model": bench.path, "dtype": args.dtype,
        "threads": bench.torch.get_num_threads(), "device": str(bench.device), "check_layers": list(check_layers),
        "separator": bench.separator, "probe_layers": args.probe_layers or list(bench.config.probe_layers),
        "sink_tokens": bench.config.sink_tokens if args.sink_tokens is None else args.sink_tokens,
        "chunk_budget_power": bench.config.chunk_budget_power, "query_funnel": bench.config.query_funnel,
        "rank_fusion": bench.config.rank_fusion,
        "modes": {m.name: {"selection": m.selection, "ratio": m.ratio} | dict(m.overrides) for m in modes},
        "tiers": bench.tiers_used, "max_passages": args.max_passages or None,
        "mean_prompt_tokens": statistics.fmean(r["num_tokens"] for r in rows),
        "prompt_format": PREFIX + " ⟨sep⟩ passage ... ⟨sep⟩ " + QUERY,
        "f1_note": "gold F1 of SmolLM2-135M is noise; fidelity to full prefill (agreement, "
                   "first_token_match, kl_first, gap_recovered) is the measure",
        "client_stats": report.jsonable(bench.client.stats())}
    summary["examples"] = rows
    return summary


def _write_json(path: str, summaries: dict) -> None:
    """``{"datasets": {name: summary}}`` to ``path``, replaced whole (a reader never sees half)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump({"datasets": summaries}, fh, indent=1)
    os.replace(path + ".tmp", path)


def checkpoint(path: str, summaries: dict) -> bool:
    """:func:`_write_json` during a run: a failure (full disk, a path gone) is logged and the run
    goes on with its rows in memory (the JSON at the end of the dataset tries again). False then."""
    try:
        _write_json(path, summaries)
        return True
    except OSError as e:
        log.warning("bench blend: checkpoint of %s failed (%s); the run goes on", path, e)
        return False


def _write(args: argparse.Namespace, summaries: dict, modes: list[Mode], selections: list[str]) -> None:
    """The JSON (:func:`_write_json`) and the PNG beside it."""
    _write_json(args.json, summaries)
    png = os.path.splitext(args.json)[0] + ".png"
    try:
        report.plot(summaries, modes, selections, png)
    except ImportError:  # e.g. the GPU machine: draw it elsewhere with --plot
        print(f"wrote {args.json} (no matplotlib here: draw the PNG with --json {args.json} --plot PNG)")
        return
    print(f"wrote {args.json} and {png}")


def _replot(json_path: str, png: str) -> int:
    """The PNG of an earlier run's JSON (its modes and selections from each dataset's meta)."""
    with open(json_path) as fh:
        summaries = json.load(fh)["datasets"]
    meta = next(iter(summaries.values()))["meta"]["modes"]
    modes = [Mode(name, m["selection"], m["ratio"]) for name, m in meta.items()]
    selections = list(dict.fromkeys(m.selection for m in modes if m.name not in ("reuse", "recompute_all")))
    report.plot(summaries, modes, selections, png)
    print(f"wrote {png}")
    return 0


def _make_tier(path: str):
    """Host + disk tiers (lz4 below host) when the tiers package has them, else memory."""
    try:
        from tiers.disk import DiskTier
        from tiers.host import HostTier
        from tiers.stack import TierStack

        stack = TierStack([HostTier(8 << 30), DiskTier(os.path.join(path, "disk"), 16 << 30, fsync=False)],
                          compression="lz4")
        return stack, ["host", "disk"]
    except ImportError:
        from tiers.tier import MemoryTier

        return MemoryTier(8 << 30, name="host"), ["memory"]


def _close(tier) -> None:
    close = getattr(tier, "close", None)
    if close is not None:
        close()

