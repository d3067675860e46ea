"""Configuration of the CacheBlend engine.

Defaults follow LMCache's blending defaults where they exist (check layer 1, recompute
ratio 0.15, min tokens 256) and the separator measured in
../shared/cases/separator-in-context.md (a newline-delimited separator keeps BPE merges from
crossing segment boundaries), except the token selection: ``query_attention`` recovers more
of full prefill's quality than CacheBlend's K deviation at the same ratio on both shared QA
sets (docs/benchmarks.md; LMCache configurations keep ``k_deviation``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiers.config import _f, check_fields

DEFAULT_SEPARATOR = "\n# #\n"
#: Longest wait for one cached layer once the blend needs it (issue 20), seconds.
DEFAULT_LOAD_TIMEOUT_S = 2.0

#: How the reused tokens to recompute are chosen (:mod:`blend.query_selection` for the
#: query-aware mode; the deviations are CacheBlend's, :mod:`blend.selection`).
SELECTIONS = ("k_deviation", "v_deviation", "kv_deviation", "query_attention", "query_k_deviation")
#: The selection LMCache's blend variables mean (CacheBlend's K deviation).
LMCACHE_SELECTION = "k_deviation"


def parse_selections(text: str) -> list[str]:
    """Comma-separated selection names (a benchmark's ``--selection``), in order.

    Raises:
        ValueError: none given, or a name not in :data:`SELECTIONS` (the message lists them).
    """
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in SELECTIONS for x in out):
        raise ValueError(f"--selection={text!r}: choose from {', '.join(SELECTIONS)}")
    return out


@dataclass(frozen=True)
class BlendConfig:
    enable_blending: bool = _f(
        True, "blend separator-delimited segments (CacheBlend); off = prefix reuse only")
    blend_separator: str = _f(
        DEFAULT_SEPARATOR, "string that separates segments of a blend prompt (LMCache's ' # # ' is accepted too)")
    check_layers: tuple[int, ...] = _f(
        (1,), "0-based layer indices where the deviation selections re-select tokens (unused by query_attention)", (0, 4096))
    recompute_ratios: tuple[float, ...] = _f(
        (0.15,), "share of reused tokens recomputed after each check layer (one value applies to all; query_attention uses the first)",
        (0.0, 1.0))
    recompute_thresholds: tuple[float, ...] = _f(
        (), "optional deviation floor per check layer: selected tokens scoring below it are not recomputed (unused by query_attention)",
        (0.0, 1e30))
    selection: str = _f(
        "query_attention", "how reused tokens are chosen for recompute: k_deviation / v_deviation / kv_deviation "
        "(CacheBlend, at the check layers), query_attention (the query's attention on the cached "
        "context, before layer 0; check_layers and recompute_thresholds unused) or query_k_deviation "
        "(half the budget by query attention, the rest by K deviation at the check layers; rank_fusion: both rankings fused)", None, SELECTIONS)
    probe_layers: tuple[int, ...] = _f(
        (), "query_attention, query_k_deviation: 0-based layers whose query attention is summed (() = the model's "
        "layers at 1/4, 3/8 and 1/2 of its depth)", (0, 4096))
    sink_tokens: int = _f(
        4, "query_attention, query_k_deviation: first tokens of every reused chunk always recomputed (inside the budget)",
        (0, 4096))
    chunk_budget_power: float = _f(
        0.0, "query_attention, query_k_deviation: 0 = one ranking of every reused token by the query's attention; > 0 = each reused chunk's "
        "share of the recompute budget grows as (its share of the query's attention) to this power", (0.0, 64.0))
    query_funnel: float = _f(
        1.0, "query_attention: 1 = the probe's choice is final; > 1 = the probe picks this many times the budget, "
        "and at the first check layer the reused tokens with the highest K deviation keep the budget", (1.0, 20.0))
    rank_fusion: int = _f(
        0, "query_k_deviation: 0 = half the budget by the query's attention, the rest by K deviation at the check "
        "layers; > 0 = the whole budget by reciprocal rank fusion of both rankings at the check layers, with this "
        "constant k (RRF's usual is 60)", (0, 10**6))
    min_tokens: int = _f(
        256, "blend only if at least this many tokens of the whole prompt would be reused", (0, 10**9))
    cost_aware: bool = _f(
        True, "price loading each hit chunk (its tier's measured latency and bandwidth) against recomputing it, and "
        "recompute the chunks that would arrive later than they compute, or the whole prompt when full prefill is "
        "sooner (issue 34); off: every hit is loaded")
    compile_layers: bool = _f(
        True, "on CUDA, torch.compile the fused Llama layers a vLLM worker blends with, once, when the worker "
        "registers its KV caches (before the first request); off, or on CPU: eager")
    probe_graph_tokens: int = _f(
        16384, "on CUDA, the query probe's layers as CUDA graphs for prompts up to this many tokens: one per layer "
        "and shape bucket, captured when the worker registers its KV caches (a request never captures; a longer "
        "prompt probes eagerly). Takes GPU memory outside vLLM's gpu_memory_utilization (up to 1,061 MiB at 16384 "
        "for a Llama-3-8B-shaped model: docs/benchmarks.md); 0 = off", (0, 262144))
    flex_warm_tokens: int = _f(
        32768, "on CUDA, FlexAttention compiled for every key bucket of prompts up to this many tokens when the "
        "worker registers its KV caches, so that a request pads its rows to a compiled shape instead of "
        "compiling one (2.4-4.7 s each); 0 = off: each new shape compiles in the request that first needs it",
        (0, 262144))
    load_timeout_s: float = _f(
        DEFAULT_LOAD_TIMEOUT_S, "seconds the blend waits for a cached layer once it needs it; past that the request is "
        "recomputed by full prefill (counted as a fallback)", (0.01, 3600.0))

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.blend_separator:
            raise ValueError("blend_separator='' is not allowed: give a non-empty string")
        if not self.check_layers:
            raise ValueError("check_layers=() is not allowed: give at least one layer index")
        if len(self.recompute_ratios) not in (1, len(self.check_layers)):
            raise ValueError(
                f"recompute_ratios={self.recompute_ratios!r} must have 1 value or one per check layer "
                f"(check_layers={self.check_layers!r})")
        if self.recompute_thresholds and len(self.recompute_thresholds) not in (1, len(self.check_layers)):
            raise ValueError(
                f"recompute_thresholds={self.recompute_thresholds!r} must be empty, 1 value or one per check layer")
        if list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError(f"check_layers={self.check_layers!r} must be strictly increasing")

    def ratio_for(self, i: int) -> float:
        """Recompute ratio of the i-th check layer."""
        return self.recompute_ratios[i if len(self.recompute_ratios) > 1 else 0]

    def threshold_for(self, i: int) -> float | None:
        if not self.recompute_thresholds:
            return None
        return self.recompute_thresholds[i if len(self.recompute_thresholds) > 1 else 0]
