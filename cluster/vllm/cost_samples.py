"""What a vLLM worker measures for the scheduler half's cost estimates (issue 34), as
:class:`CostSamples`: its blends' and prefills' compute, its blends' transfers, and, once at
start-up on a GPU, prefills longer than passages (:func:`calibration_samples`).

Built by the worker each step (:func:`samples_of` after every blend and prefill), carried in
vLLM's worker metadata and folded in by :class:`cluster.vllm.costs.CostEstimator` in the
scheduler's process; ``kvblend bench gpu --placement`` feeds its estimator the same way.
Bookkeeping only: no torch.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass, field

from blend.plan import BlendPlan

#: the kinds of compute sample: a blend, and a prefill of every row (the engine's own:
#: canonical KV of stored chunks, fallbacks); each has its own fit (a blend has more fixed cost)
BLEND, PREFILL = "blend", "prefill"
#: prompt lengths a worker prefills once at start-up (:func:`calibration_samples`): longer than
#: passages, where a GPU's prefill leaves the launch-bound floor
CALIBRATION_TOKENS = (1024, 2048, 4096)


@dataclass
class CostSamples:
    """Measurements of one worker step, sent to the scheduler half (picklable).

    Attributes:
        compute: ``(rows per layer, keys, seconds, kind)`` per blend (kind :data:`BLEND`) or
            prefill (:data:`PREFILL`).
        transfer: ``({tier: bytes}, seconds, waited, busy)`` per blend that loaded chunks:
            seconds from asking for its layers to the last one's arrival, seconds the engine
            waited for them (the transfer took between the two), and the source's own busy
            seconds (None where the source does not measure them: a point within that span).
        blends: ``({tier: bytes}, rows per layer, keys, compute seconds, wall seconds)`` per
            blend that loaded chunks (wall: its compute plus its load waits): its compute sample
            (not in ``compute``) and the overlap's.
    """

    compute: list[tuple[float, int, float, str]] = field(default_factory=list)
    transfer: list[tuple[dict[str, int], float, float, float | None]] = field(default_factory=list)
    blends: list[tuple[dict[str, int], float, int, float, float]] = field(default_factory=list)

    def merge(self, other: CostSamples) -> CostSamples:
        return CostSamples(self.compute + other.compute, self.transfer + other.transfer,
                           self.blends + other.blends)

    def __bool__(self) -> bool:
        return bool(self.compute or self.transfer or self.blends)


def samples_of(counters, keys: int, plan: BlendPlan | None = None, per_token: int = 0,
               local: Collection = ()) -> CostSamples:
    """What one blend or prefill measured (its :class:`blend.result.BlendCounters`), as samples:
    its compute (rows per layer, ``keys`` tokens, load waits excluded) and, for a blend of
    ``plan`` that loaded chunks, their bytes per tier (``per_token`` bytes a token), the
    seconds to the last layer's arrival, the seconds the engine waited for layers and the
    source's own busy seconds (``transfer_busy_s``). Chunks
    in ``local`` (keys the worker's gpu tier held, though the lookup named the tier below, and
    the counters' ``unfit_keys`` and ``lost_keys``, computed because the source could not hold
    them or had lost them: no transfer)
    are left out of the bytes; a blend that read only those has no transfer
    sample. Called by the vLLM worker after each blend and prefill, and by
    ``kvblend bench gpu --placement`` the same way."""
    out = CostSamples()
    by_tier: dict[str, int] | None = None
    if plan is not None and counters.transfer_s > 0 and counters.full_prefill_reason is None and per_token:
        by_tier = {}
        local = set(local) | set(getattr(counters, "unfit_keys", ())) | set(getattr(counters, "lost_keys", ()))
        for seg in plan.hit_segments:
            if seg.key not in local:
                by_tier[seg.tier] = by_tier.get(seg.tier, 0) + seg.num_tokens * per_token
        if by_tier:
            out.transfer.append((by_tier, counters.transfer_s, min(counters.load_wait_s, counters.transfer_s),
                                 getattr(counters, "transfer_busy_s", None)))
        else:
            by_tier = None
    rows = counters.recomputed_tokens_per_layer
    if rows and counters.compute_s > 0:
        mean = sum(rows) / len(rows)
        if by_tier is not None:  # a blend that loaded: its compute and wall time together
            out.blends.append((by_tier, mean, keys, counters.compute_s, counters.compute_s + counters.load_wait_s))
        else:
            kind = BLEND if counters.num_hit_segments and counters.full_prefill_reason is None else PREFILL
            out.compute.append((mean, keys, counters.compute_s, kind))
    return out


def calibration_samples(engine, max_tokens: int, tokens: tuple[int, ...] = CALIBRATION_TOKENS) -> CostSamples:
    """Prefill samples of prompts longer than passages, for a worker whose own prefills are all
    passage-sized (module docstring, **Compute**): each of ``tokens`` up to ``max_tokens``
    (the context window), random token ids, prefilled twice through ``engine`` (a
    :class:`blend.engine.BlendEngine`; the first run warms the shape) and the second measured.
    Who calls it: the vLLM worker once at start-up on a GPU (~0.2 s for a 7B-shaped model on an
    H100), and ``kvblend bench gpu --placement`` as that worker does. Empty when nothing fits.
    """
    rng = random.Random(0)
    vocab = max(2, int(engine.spec.vocab_size))
    out = CostSamples()
    for n in tokens:
        if n > max_tokens:
            continue
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        engine.prefill(ids, want_logits=False)
        out = out.merge(samples_of(engine.prefill(ids, want_logits=False).counters, n))
    return out
