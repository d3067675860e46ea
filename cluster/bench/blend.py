"""``kvblend bench blend``: CacheBlend quality and TTFT against full prefill, on a real QA set.

Per example (rows of ../shared/data/qa/, MuSiQue by default, the first N):

1. every passage's canonical KV (the passage alone at 0..n-1, no BOS) is computed and put
   into the tiers (host + disk under a :class:`~cluster.cache.local.LocalCacheClient`);
2. the prompt ``PREFIX ⟨sep⟩ p1 ⟨sep⟩ ... ⟨sep⟩ p10 ⟨sep⟩ QUERY`` (see :data:`PREFIX`,
   :data:`QUERY`: the model's chat format, answer within 5 words) is answered by
   (a) ``full``: the HF model's own forward with SDPA (the fastest full prefill here) and
   (b) ``blend_<ratio>``: plan (one batched lookup) + :meth:`BlendEngine.blend` reading KV
   through the tiers, both timed from token ids to the first token's logits, same dtype and
   thread count, after a warm-up;
3. the answer is decoded greedily (``max_new_tokens`` 16) from each mode's KV by the same HF
   decode loop, and scored.

JSON: one object per mode with ``ttft_s`` (median), ``ttft_ratio`` (median blend / median
full), ``f1`` (max over gold answers, SQuAD normalization; with SmolLM2-135M it is noise),
``agreement`` (token F1 vs the full-prefill answer) and its bootstrap 90% interval,
``first_token_match``, ``kl_first`` (mean KL(p_full || p_blend) of the first token),
``nll_self`` (mean per-token NLL of the full-prefill answer teacher-forced on the mode's KV),
``gap_recovered`` ((nll_self at ratio 0 - nll_self) / (nll_self at ratio 0 - nll_self of full),
ratio of means), ``nll_gold``, ``recomputed_tokens`` (rows computed above the check layer),
``reused_tokens``. A PNG of quality and TTFT against the ratio sits beside the JSON.
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

log = logging.getLogger(__name__)

PREFIX = ("<|im_start|>system\nYou will be asked a question after reading several passages. "
          "Answer the question based on the given passages. Do not repeat the question. "
          "The answer should be within 5 words.<|im_end|>\n<|im_start|>user\nPassages:")
QUERY = "Question: {question}\nAnswer within 5 words.<|im_end|>\n<|im_start|>assistant\n"
DEFAULT_RATIOS = "0,0.05,0.15,0.3,1.0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", required=True, metavar="PATH", help="write results here (a PNG goes beside it)")
    p.add_argument("--dataset", default="musique", help="musique, wikimqa or a *.norm.jsonl path")
    p.add_argument("--num-examples", type=int, default=20, help="first N rows (default 20)")
    p.add_argument("--ratios", default=DEFAULT_RATIOS, help=f"recompute ratios (default {DEFAULT_RATIOS})")
    p.add_argument("--check-layers", default="1", help="0-based check layers, comma-separated (default 1)")
    p.add_argument("--model", default="smollm2", help="bundled model name or HF folder (default smollm2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="model and KV dtype")
    p.add_argument("--threads", type=int, default=0, help="torch threads for both modes (0: torch default)")
    p.add_argument("--max-passages", type=int, default=0, help="use only the first K passages (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--score", default="k", choices=("k", "v", "kv"),
                   help="deviation ranking reused tokens at the check layer (default k, the paper's)")
    p.add_argument("--separator", default=None, help="segment separator (default: blend config's)")


def _floats(text: str, name: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}={text!r}: expected comma-separated numbers") from None
    if not vals:
        raise ValueError(f"--{name}={text!r}: give at least one value")
    return vals


def _decode(model, kv, first_logits, max_new_tokens: int, eos_ids, torch):
    """Greedy answer from a prompt's KV (list of [2, T, H, D]) and its last logits [V]."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, layer in enumerate(kv):
        cache.update(layer[0].transpose(0, 1)[None], layer[1].transpose(0, 1)[None], i)
    num_tokens = kv[0].shape[1]
    out = [int(first_logits.argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        pos = num_tokens + len(out) - 1
        with torch.no_grad():
            logits = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[pos]])).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


def _nll(model, kv, first_logits, target, torch) -> float:
    """Mean per-token NLL of ``target`` ids teacher-forced after the prompt's KV."""
    from transformers import DynamicCache

    if not target:
        return float("nan")
    logp = [torch.log_softmax(first_logits.float(), -1)[target[0]]]
    if len(target) > 1:
        cache = DynamicCache()
        for i, layer in enumerate(kv):
            cache.update(layer[0].transpose(0, 1)[None], layer[1].transpose(0, 1)[None], i)
        num_tokens = kv[0].shape[1]
        with torch.no_grad():
            logits = model(torch.tensor([target[:-1]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(num_tokens, num_tokens + len(target) - 1)[None]).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        logp += [lp[j, t] for j, t in enumerate(target[1:])]
    return float(-torch.stack(logp).mean())


def _bootstrap(values: list[float], seed: int = 0, rounds: int = 2000) -> list[float]:
    import random

    if not values:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(rounds))
    return [means[int(0.05 * rounds)], means[int(0.95 * rounds) - 1]]


def _plot(summary: dict, ratios: list[float], modes: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("agreement", "first_token_match", "gap_recovered"):
        ax1.plot(ratios, [summary[m][key] for m in modes], marker="o", label=key)
    ax1.set_xlabel("recompute ratio")
    ax1.set_ylabel("fidelity to full prefill")
    ax1.set_ylim(-0.05, 1.05)
    ax1.legend()
    ax2.plot(ratios, [summary[m]["ttft_ratio"] for m in modes], marker="o", label="blend / full")
    ax2.axhline(1.0, color="gray", linestyle="--", label="full prefill")
    ax2.set_xlabel("recompute ratio")
    ax2.set_ylabel("TTFT ratio (median)")
    ax2.legend()
    fig.suptitle(f"kvblend bench blend ({summary['meta']['dataset']}, N={summary['meta']['num_examples']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """The benchmark: set up once, then per example store its passages, time and decode full
    prefill, time and decode each blend ratio; write the JSON, the PNG and a table."""
    import torch
    from tqdm import tqdm

    ratios = _floats(args.ratios, "ratios")
    names = [f"blend_{x.strip()}" for x in args.ratios.split(",") if x.strip()]  # as typed: blend_0.15
    check_layers = tuple(int(x) for x in _floats(args.check_layers, "check-layers"))
    if any(not 0 <= r <= 1 for r in ratios):
        raise ValueError(f"--ratios={args.ratios!r}: each ratio must be in [0, 1]")
    if args.num_examples <= 0:
        raise ValueError(f"--num-examples={args.num_examples} must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = _Bench(args, check_layers)
    rows: list[dict] = []
    warmed = False
    for ex in tqdm(bench.examples, desc="bench blend", unit="example"):
        passages = list(ex.passages[:args.max_passages] if args.max_passages else ex.passages)
        bench.store_passages(passages)
        ids, spans = bench.prompt(passages, ex.question)
        if not warmed:  # warm-up, excluded: allocator, thread pools, first-call paths
            bench.full_forward(ids[:256])
            bench.engine.blend(bench.plan_for(ids, spans, ratios[0]))
            warmed = True
        row, full = bench.full_mode(ex, ids)
        for ratio, name in zip(ratios, names, strict=True):
            row[name] = bench.blend_mode(ex, ids, spans, ratio, full)
        rows.append(row)
    _write(args, bench, rows, ratios, names, check_layers)
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
        from cluster.namespace import namespace_for
        from cluster.workloads.model import resolve_model
        from cluster.workloads.qa import load_examples, resolve_dataset

        self.torch, self.args, self.check_layers = torch, args, check_layers
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
        config = load_config(environ=dict(os.environ))
        self.path = resolve_model(args.model, cache_dir(config))
        self.separator = args.separator or config.blend.blend_separator
        self.examples = load_examples(resolve_dataset(args.dataset), limit=args.num_examples)
        self.tokenizer = tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.adapter = HFModelAdapter.from_pretrained(self.path, dtype=dtype)
        self.model = self.adapter.model
        self.namespace = namespace_for(self.path, args.dtype).digest()
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eos_ids = {i for i in (tokenizer.eos_token_id, self.im_end) if i is not None}
        self._tmp = tempfile.TemporaryDirectory(prefix="kvblend-bench-")
        self.tier, self.tiers_used = _make_tier(self._tmp.name)
        self.client = LocalCacheClient(self.tier)
        self.engine = BlendEngine(self.adapter, self.client, score=args.score)

    def close(self) -> None:
        _close(self.tier)
        self._tmp.cleanup()

    def plan_for(self, ids, spans, ratio: float):
        from blend.config import BlendConfig
        from blend.planner import make_plan

        cfg = BlendConfig(blend_separator=self.separator, check_layers=self.check_layers,
                          recompute_ratios=(ratio,), min_tokens=0)
        return make_plan(ids, spans, self.namespace, self.client, cfg, query_to_engine=True)

    def full_forward(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids]), use_cache=True)
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
        t0 = time.perf_counter()
        out = self.full_forward(ids)
        full_logits = out.logits[0, -1].float()
        ttft_full = time.perf_counter() - t0
        cache = out.past_key_values
        full_kv = [torch.stack((cache.layers[i].keys[0].transpose(0, 1), cache.layers[i].values[0].transpose(0, 1)))
                   for i in range(self.adapter.spec.num_layers)]
        del out
        full_answer = _decode(model, full_kv, full_logits, self.args.max_new_tokens, self.eos_ids, torch)
        full_text = tokenizer.decode(full_answer, skip_special_tokens=True).strip()
        gold = chunk_token_ids(tokenizer, ex.answers[0]) + [self.im_end] if ex.answers else []
        row = {"id": ex.id, "num_tokens": len(ids), "full": {
            "ttft_s": ttft_full, "answer": full_text, "f1": max_f1(full_text, ex.answers),
            "agreement": 1.0, "first_token_match": 1.0, "kl_first": 0.0,
            "nll_self": _nll(model, full_kv, full_logits, full_answer, torch),
            "nll_gold": _nll(model, full_kv, full_logits, gold, torch),
            "recomputed_tokens": len(ids), "reused_tokens": 0}}
        return row, _Full(full_answer, full_text, torch.softmax(full_logits, -1), gold)

    def blend_mode(self, ex, ids: list[int], spans, ratio: float, full: _Full) -> dict:
        """One blend mode's entry: plan + blend timed to the first logits, decoded, compared."""
        from cluster.workloads.qa import max_f1, token_f1

        torch, model = self.torch, self.model
        t0 = time.perf_counter()
        plan = self.plan_for(ids, spans, ratio)
        res = self.engine.blend(plan)
        ttft = time.perf_counter() - t0
        answer = _decode(model, res.kv, res.logits, self.args.max_new_tokens, self.eos_ids, torch)
        text = self.tokenizer.decode(answer, skip_special_tokens=True).strip()
        p_full = full.p_full
        log_p_blend = torch.log_softmax(res.logits, -1)
        return {
            "ttft_s": ttft, "answer": text, "f1": max_f1(text, ex.answers),
            "agreement": token_f1(text, full.text),
            "first_token_match": float(answer[0] == full.answer[0]),
            "kl_first": float((p_full * (torch.log(p_full.clamp_min(1e-30)) - log_p_blend)).sum()),
            "nll_self": _nll(model, res.kv, res.logits, full.answer, torch),
            "nll_gold": _nll(model, res.kv, res.logits, full.gold, torch),
            "recomputed_tokens": int(res.recompute_idx.numel()),
            "reused_tokens": res.counters.reused_tokens,
            "load_wait_s": res.counters.load_wait_s,
            "full_prefill_reason": res.counters.full_prefill_reason}


def _write(args: argparse.Namespace, bench: _Bench, rows: list[dict], ratios: list[float], names: list[str],
           check_layers: tuple[int, ...]) -> None:
    """The summary JSON, the PNG beside it and the table on stdout."""
    summary = _summarize(rows, names)
    summary["meta"] = {
        "dataset": args.dataset, "num_examples": len(rows), "model": bench.path, "dtype": args.dtype,
        "threads": bench.torch.get_num_threads(), "check_layers": list(check_layers),
        "separator": bench.separator, "score": args.score,
        "tiers": bench.tiers_used, "max_passages": args.max_passages or None,
        "mean_prompt_tokens": statistics.fmean(r["num_tokens"] for r in rows),
        "prompt_format": PREFIX + " ⟨sep⟩ passage ... ⟨sep⟩ " + QUERY,
        "f1_note": "gold F1 of SmolLM2-135M is noise; fidelity to full prefill (agreement, "
                   "first_token_match, kl_first, gap_recovered) is the measure",
        "client_stats": _jsonable(bench.client.stats())}
    summary["examples"] = rows
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(summary, fh, indent=1)
    png = os.path.splitext(args.json)[0] + ".png"
    _plot(summary, ratios, names, png)
    _print(summary, names)
    print(f"wrote {args.json} and {png}")


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


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def _summarize(rows: list[dict], names: list[str]) -> dict:
    modes = ["full"] + names
    keys = ("f1", "agreement", "first_token_match", "kl_first", "nll_self", "nll_gold",
            "recomputed_tokens", "reused_tokens")
    full_ttft = statistics.median(r["full"]["ttft_s"] for r in rows)
    out: dict = {}
    for m in modes:
        vals = [r[m] for r in rows]
        s = {"ttft_s": statistics.median(v["ttft_s"] for v in vals)}
        s["ttft_ratio"] = s["ttft_s"] / full_ttft
        for k in keys:
            xs = [v[k] for v in vals if v[k] == v[k]]  # drop NaN
            s[k] = statistics.fmean(xs) if xs else float("nan")
        s["agreement_ci90"] = _bootstrap([v["agreement"] for v in vals])
        out[m] = s
    zero = next((out[m] for m in names if float(m.removeprefix("blend_")) == 0.0), None)
    for m in modes:
        if zero is None:
            out[m]["gap_recovered"] = None
            continue
        gap = zero["nll_self"] - out["full"]["nll_self"]
        out[m]["gap_recovered"] = (zero["nll_self"] - out[m]["nll_self"]) / gap if gap else None
    return out


def _print(summary: dict, names: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvblend bench blend (fidelity to full prefill)")
    cols = ("ttft_s", "ttft_ratio", "agreement", "first_token_match", "kl_first", "nll_self",
            "gap_recovered", "f1", "recomputed_tokens")
    table.add_column("mode")
    for c in cols:
        table.add_column(c, justify="right")
    for m in ["full"] + names:
        s = summary[m]
        table.add_row(m, *("-" if s[c] is None else f"{s[c]:.3f}" for c in cols))
    Console().print(table)
