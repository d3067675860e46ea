"""Scoring and reporting of ``kvblend bench blend`` (:mod:`cluster.bench.blend`).

Greedy decoding and teacher-forced NLL from a prompt's KV (a list of ``[2, T, H, D]`` layers,
on any device), the per-mode summary (medians of TTFT, means of the quality metrics, a
bootstrap 90% interval of agreement, gap recovered against the shared ``reuse`` row), the
rich table and the PNG. Only the standard library is imported at module level.
"""

from __future__ import annotations

import json
import statistics


def _hf_cache(kv):
    """A transformers ``DynamicCache`` holding a prompt's KV (list of ``[2, T, H, D]`` layers)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, layer in enumerate(kv):
        cache.update(layer[0].transpose(0, 1)[None], layer[1].transpose(0, 1)[None], i)
    return cache


def decode_greedy(model, kv, first_logits, max_new_tokens: int, eos_ids, torch):
    """Greedy answer from a prompt's KV (list of [2, T, H, D], on the model's device) and its
    last logits [V]: token ids, at most ``max_new_tokens``, ending at an ``eos_ids`` token."""
    cache = _hf_cache(kv)
    num_tokens = kv[0].shape[1]
    out = [int(first_logits.argmax())]
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        pos = num_tokens + len(out) - 1
        with torch.no_grad():
            logits = model(torch.tensor([[out[-1]]], device=kv[0].device), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[pos]], device=kv[0].device)).logits[0, -1]
        out.append(int(logits.argmax()))
    return out


def answer_nll(model, kv, first_logits, target, torch) -> float:
    """Mean per-token NLL of ``target`` ids teacher-forced after the prompt's KV."""
    if not target:
        return float("nan")
    logp = [torch.log_softmax(first_logits.float(), -1)[target[0]]]
    if len(target) > 1:
        cache = _hf_cache(kv)
        num_tokens = kv[0].shape[1]
        with torch.no_grad():
            dev = kv[0].device
            logits = model(torch.tensor([target[:-1]], device=dev), past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(num_tokens, num_tokens + len(target) - 1, device=dev)[None]
                           ).logits[0]
        lp = torch.log_softmax(logits.float(), -1)
        logp += [lp[j, t] for j, t in enumerate(target[1:])]
    return float(-torch.stack(logp).mean())


def bootstrap_ci90(values: list[float], seed: int = 0, rounds: int = 2000) -> list[float]:
    import random

    if not values:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(rounds))
    return [means[int(0.05 * rounds)], means[int(0.95 * rounds) - 1]]


def summarize(rows: list[dict], names: list[str]) -> dict:
    modes = ["full"] + names
    keys = ("f1", "agreement", "first_token_match", "kl_first", "nll_self", "nll_gold",
            "recomputed_tokens", "reused_tokens")
    full_ttft = statistics.median(r["full"]["ttft_s"] for r in rows)
    out: dict = {}
    for m in modes:
        vals = [r[m] for r in rows]
        s = {"ttft_s": statistics.median(v["ttft_s"] for v in vals)}
        s["ttft_ratio"] = s["ttft_s"] / full_ttft
        s["ttft_ratio_iqr"] = quartiles([v["ttft_s"] / r["full"]["ttft_s"] for v, r in zip(vals, rows, strict=True)])
        s["probe_share"] = statistics.median(v["probe_share"] for v in vals)
        for k in keys:
            xs = [v[k] for v in vals if v[k] == v[k]]  # drop NaN
            s[k] = statistics.fmean(xs) if xs else float("nan")
        s["agreement_ci90"] = bootstrap_ci90([v["agreement"] for v in vals])
        out[m] = s
    zero = out.get("reuse")
    for m in modes:
        if zero is None:
            out[m]["gap_recovered"] = None
            continue
        gap = zero["nll_self"] - out["full"]["nll_self"]
        out[m]["gap_recovered"] = (zero["nll_self"] - out[m]["nll_self"]) / gap if gap else None
    return out


def quartiles(xs: list[float]) -> list[float]:
    """``[q1, q3]`` of the per-example values (the spread behind a median)."""
    if len(xs) < 2:
        return [xs[0], xs[0]] if xs else [float("nan")] * 2
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def print_table(summary: dict, modes: list) -> None:
    from rich.console import Console
    from rich.table import Table

    meta = summary["meta"]
    table = Table(title=f"kvblend bench blend: {meta['dataset']}, N={meta['num_examples']}, "
                        f"{meta['mean_prompt_tokens']:.0f} prompt tokens (fidelity to full prefill)")
    cols = ("ttft_s", "ttft_ratio", "probe_share", "agreement", "first_token_match", "kl_first", "nll_self",
            "gap_recovered", "recomputed_tokens", "reused_tokens")
    table.add_column("mode")
    for c in cols:
        table.add_column(c, justify="right")
    for m in ["full"] + [m.name for m in modes]:
        s = summary[m]
        cells = []
        for c in cols:
            v = s[c]
            if v is None:
                cells.append("-")
            elif c == "agreement":
                lo, hi = s["agreement_ci90"]
                cells.append(f"{v:.3f} ({lo:.2f}-{hi:.2f})")
            else:
                cells.append(f"{v:.3f}" if c not in ("recomputed_tokens", "reused_tokens") else f"{v:.0f}")
        table.add_row(m, *cells)
    Console().print(table)


def plot(summaries: dict, modes: list, selections: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def line_of(m) -> str:  # a line per selection, and per variant of one (<selection>+<variant>)
        return m.name.rsplit("@", 1)[0] if "+" in m.name else m.selection

    blended = [m for m in modes if m.name not in ("reuse", "recompute_all")]
    lines = list(dict.fromkeys([line_of(m) for m in blended if m.selection in selections]))
    fig, axes = plt.subplots(2, len(summaries), figsize=(5.5 * len(summaries), 8), squeeze=False)
    for col, (dataset, summary) in enumerate(summaries.items()):
        for row, key in enumerate(("gap_recovered", "agreement")):
            ax = axes[row][col]
            for sel in lines:
                pts = [m for m in modes if line_of(m) == sel or m.name in ("reuse", "recompute_all")]
                pts = sorted(pts, key=lambda m: m.ratio)
                xs = [summary[m.name]["ttft_ratio"] for m in pts]
                ys = [summary[m.name][key] for m in pts]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=sel)
                for m, x, y in zip(pts, xs, ys, strict=True):
                    if y is not None and sel == lines[0]:
                        ax.annotate(f"{m.ratio:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, -9))
            ax.set_xlabel("TTFT / full prefill (median)")
            ax.set_ylabel(key.replace("_", " "))
            ax.set_title(f"{dataset}, N={summary['meta']['num_examples']}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("kvblend bench blend: quality against TTFT\nper selection and variant (labels: recompute ratio)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def jsonable(obj):
    return json.loads(json.dumps(obj, default=str))
