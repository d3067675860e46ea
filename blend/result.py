"""What one blend request returns (:class:`BlendResult`) and what it did (:class:`BlendCounters`).

:class:`blend.engine.BlendEngine` fills both, for a blended request and for full prefill
alike; the vLLM connector turns the counters into metrics and events. Axis letters as in
:mod:`blend.engine`: ``T`` prompt tokens blended, ``A`` rows computed above the last check
layer, ``H`` KV heads, ``D`` head dim, ``V`` vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class BlendCounters:
    """What one request did (plain numbers; the connector turns them into metrics).

    Attributes:
        num_segments: chunk segments in ``[0, blend_end)``.
        num_hit_segments: of those, cached and used (0 when the request fell back to prefill).
        reused_tokens: tokens whose KV could come from the cache (hit rows; the last row is
            always computed when logits are wanted).
        computed_tokens: the other tokens (prefix, separators, missed chunks, query), computed
            in every layer.
        selected_tokens: reused tokens recomputed: chosen at the last check layer, or by the
            query's attention before layer 0 (``query_attention``).
        recomputed_tokens_per_layer: rows computed in each layer (``T`` up to the first check layer).
        selection: how reused tokens were chosen (:data:`blend.config.SELECTIONS`; ``forced``
            for ``plan.forced_recompute``; ``""`` without hits).
        selection_fallback: why the plan's selection was not used (e.g. ``"no query
            segment"`` for ``query_attention``), None when it was.
        probe_s: seconds computing the ``query_attention`` probe and selection (part of
            ``compute_s``; its load waits are in ``load_wait_s``).
        load_wait_s: time the engine waited for the source.
        compute_s: the rest of the request's wall time.
        transfer_s: seconds from asking the source for the cached layers to the last one's
            arrival (0 when none was asked for or not all arrived); the cost estimates'
            transfer sample (:mod:`cluster.vllm.costs`).
        transfer_busy_s: seconds the source itself spent moving those layers, its waits for
            the engine left out (the last layer's ``busy_s``: :class:`tiers.codec.LayerBatch`);
            None when the source does not measure it. A transfer hidden under compute shows
            its own time here, where ``transfer_s`` only bounds it.
        unfit_segments: hit chunks the source could not hold at once (a cache agent's arena
            smaller than the request), computed instead of loaded; unfit_keys: their keys (no
            transfer: left out of the cost estimates' transfer sample).
        lost_segments: hit chunks found at lookup but missing (or malformed) when read:
            computed instead (the request was blended again with them as misses, not sent to
            full prefill); lost_keys: their keys (no transfer, as ``unfit_keys``).
        full_prefill_reason: why the request was computed by full prefill (None when blended).
    """

    num_segments: int = 0
    num_hit_segments: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    selected_tokens: int = 0
    recomputed_tokens_per_layer: list[int] = field(default_factory=list)
    selection: str = ""
    selection_fallback: str | None = None
    probe_s: float = 0.0
    load_wait_s: float = 0.0
    compute_s: float = 0.0
    transfer_s: float = 0.0
    transfer_busy_s: float | None = None
    unfit_segments: int = 0
    unfit_keys: tuple = ()
    lost_segments: int = 0
    lost_keys: tuple = ()
    full_prefill_reason: str | None = None


@dataclass(frozen=True)
class BlendResult:
    """Output of one request.

    Attributes:
        kv: per layer ``[2, T, H, D]`` (K then V) in the model dtype, K rotated at 0..T-1.
        logits: ``[V]`` float32 next-token logits after token ``T-1`` (None unless wanted).
        recompute_idx: ``[A]`` int64 prompt indices computed above the last check layer.
        counters: what the request did.
    """

    kv: list[torch.Tensor]
    logits: torch.Tensor | None
    recompute_idx: torch.Tensor
    counters: BlendCounters
