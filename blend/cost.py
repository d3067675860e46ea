"""Cost-aware plans: load a hit chunk, or recompute it, whichever brings the first token sooner.

On a GPU a chunk read from disk, Redis or S3 can arrive later than the chunk could be
recomputed (issue 34: a disk-tier blend of a 7B-shaped model was 2.0-3.7x slower than full
prefill on an H200; SIFT, arXiv 2606.09441, finds the same); on a CPU the opposite holds. So the
planner prices both, from estimates kept up to date by the process that serves
(:class:`CostEstimates`), and :func:`choose` decides per hit chunk when the plan is built.

The model of one blend (CacheBlend's layer pipeline, Yao et al., EuroSys 2025, §5: layer
``l + 1``'s KV moves while layer ``l`` computes)::

    rows(L)     = always computed rows + tokens of the hits not in L + ceil(ratio * tokens of L)
                  (per layer on average: CacheBlend's deviation selections compute all T rows
                  up to the first check layer)
    compute(L)  = compute_s(rows(L), T)
                  (every row at the estimates' one rate, a split's added rows too:
                  :meth:`cluster.vllm.costs.CostEstimator.row_rate`)
    transfer(L) = estimates.transfer_s({tier: bytes of L's chunks there})
    blend(L)    = max(compute, transfer) + min(compute, transfer) * (1 - overlap + overlap / num_layers)

for the set ``L`` of hit chunks loaded (the others are recomputed with the prompt's new
tokens, like misses). ``overlap`` is the share of the shorter of compute and transfer that
hides under the longer: 1 is the pipeline at its best (only its first layer shows), 0 is one
after the other. It is measured, not assumed (:attr:`CostEstimates.overlap`): on an H100 a
16K-token blend that recomputed half its chunks while reading the other half from disk took
0.65 s, the sum of its compute and its reads (0.30 + 0.30 s), where a perfect pipeline prices
0.31 s and full prefill took 0.52 s (``docs/benchmarks.md``, the placement run).

Full prefill costs ``prefill_s(T)``. Chunks are ordered by their transfer time per token (the
fastest tiers first) and every prefix of that order is priced, from "load none" (full prefill)
to "load all" (today's plan); the cheapest wins, ties going to more loads, and anything but
"load all" only when it is :data:`MARGIN` sooner. So when some chunks are fast and others slow
the slow ones are recomputed while the fast ones load: Cake (Jin et al., arXiv 2410.03065)
computes the front of a prompt while the back loads; here the split falls per chunk, in CacheBlend's pipeline, wherever the prices say.

Until the estimates know the compute speed (``compute_known`` false: no request measured yet)
every hit is loaded, as before this choice existed. So is every hit of a plan whose recompute
ratio is 1.0: it recomputes every row anyway, so it is never sooner than full prefill; it is
the check that blending with loaded KV equals full prefill (LMCache's blend recipe, the
oracle tests), and what it asks for is loading. ``explore``: tiers to load at least one
chunk of (their fastest) whatever the prices, so a tier that was slow and recovered is
measured again (the caller decides which; :mod:`cluster.vllm.costs` does, every few plans).

Bookkeeping only: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from blend.plan import CHUNK, BlendPlan

#: a choice other than loading every hit must be expected this much sooner (a share of the
#: always-load time): estimates are noisy
MARGIN = 0.1


class CostEstimates(Protocol):
    """What :func:`choose` needs to know, in seconds (implemented by
    :class:`cluster.vllm.costs.CostEstimator`)."""

    @property
    def compute_known(self) -> bool:
        """Whether :meth:`compute_s` rests on measurements (False: none yet)."""
        ...

    def compute_s(self, rows: float, keys: int) -> float:
        """Seconds of a blend's compute: ``rows`` prompt rows (per layer, on average) through
        every layer, attending causally over a prompt of ``keys`` tokens."""
        ...

    def prefill_s(self, tokens: int) -> float:
        """Seconds of full prefill of ``tokens`` tokens."""
        ...

    def transfer_s(self, bytes_by_tier: Mapping[str, int]) -> float:
        """Seconds until every layer of chunks holding ``bytes_by_tier`` bytes (per tier that
        answered their lookup) is on the device; 0 for no bytes."""
        ...

    @property
    def overlap(self) -> float:
        """In [0, 1]: the share of the shorter of a blend's compute and transfer that runs
        under the longer (:func:`blend_seconds`)."""
        ...


@dataclass(frozen=True)
class CostChoice:
    """What :func:`choose` decided for one plan, and the prices it compared.

    Attributes:
        recomputed: indices into ``plan.segments`` of the hit chunks recomputed instead of loaded.
        full_prefill: recomputing every hit was cheapest (the plan falls back to full prefill).
        blend_s: the expected time of the choice (``full_s`` when ``full_prefill``).
        always_load_s: the expected time of loading every hit.
        full_s: the expected time of full prefill of ``[0, blend_end)``.
        tiers: per hit chunk (in segment order) ``(segment index, tier, tokens, "load" |
            "recompute")``, for the event log.
    """

    recomputed: tuple[int, ...]
    full_prefill: bool
    blend_s: float
    always_load_s: float
    full_s: float
    tiers: tuple[tuple[int, str, int, str], ...]


def kv_bytes_per_token(spec, itemsize: int) -> int:
    """Bytes of one token's KV in every layer (K and V) of a model of ``spec``
    (:class:`blend.protocols.ModelSpec`) stored at ``itemsize`` bytes per element."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize


def blend_seconds(compute_s: float, transfer_s: float, num_layers: int, overlap: float = 1.0) -> float:
    """The layer pipeline's time: the longer of compute and transfer, plus the share of the
    shorter one that does not overlap it (``1 - overlap``) and, of the share that does, its
    first layer (the pipeline fills and drains once). ``overlap`` is clamped to [0, 1]."""
    o = min(1.0, max(0.0, overlap))
    return max(compute_s, transfer_s) + min(compute_s, transfer_s) * (1.0 - o + o / max(1, num_layers))


def choose(plan: BlendPlan, estimates: CostEstimates, *, kv_bytes_per_token: int, num_layers: int,
           explore: Collection[str] = ()) -> CostChoice | None:
    """Price loading against recomputing each hit chunk of ``plan`` (module docstring).

    Args:
        plan: a plan that blends (:func:`blend.planner.make_plan`); its hits carry their tier.
        estimates: the serving process's :class:`CostEstimates`.
        kv_bytes_per_token: bytes of one token's KV in every layer (K and V), as stored.
        num_layers: the model's decoder layers.
        explore: tiers of which at least the fastest chunk is loaded whatever the prices.

    Returns:
        The choice, or None when there is nothing to choose (no hit, the plan does not blend,
        recomputes every row, or the compute speed is not known yet: every hit is loaded).
    """
    if not plan.blend or not estimates.compute_known or min(plan.recompute_ratios, default=0.0) >= 1.0:
        return None
    hits = [(i, s) for i, s in enumerate(plan.segments)
            if s.kind == CHUNK and s.hit and s.end <= plan.blend_end]
    if not hits:
        return None
    keys = plan.blend_end
    ratio = plan.recompute_ratios[0] if plan.recompute_ratios else 0.0
    hit_tokens = sum(s.num_tokens for _, s in hits)
    base_rows = keys - hit_tokens

    def per_token(item) -> float:
        _, s = item
        return estimates.transfer_s({s.tier: s.num_tokens * kv_bytes_per_token}) / max(1, s.num_tokens)

    order = sorted(hits, key=per_token)  # stable: equal tiers keep prompt order
    forced = set()
    for tier in explore:
        first = next((i for i, s in order if s.tier == tier), None)
        if first is not None:
            forced.add(first)
    order = [h for h in order if h[0] in forced] + [h for h in order if h[0] not in forced]

    # CacheBlend's deviation selections compute every row up to the first check layer; the
    # query funnel computes its wider set there (query_selection.funnel)
    below = min(num_layers, plan.check_layers[0] + 1) if plan.check_layers else 0
    whole = 0 if plan.selection == "query_attention" else below
    wide = plan.funnel_ratio or 0.0
    narrow = below if wide else 0

    overlap = estimates.overlap

    def mean_rows(tokens: int) -> float:
        rows = base_rows + (hit_tokens - tokens) + math.ceil(ratio * tokens - 1e-9)  # as num_to_select
        wide_rows = base_rows + (hit_tokens - tokens) + math.ceil(wide * tokens - 1e-9)
        return (whole * keys + narrow * wide_rows + (num_layers - whole - narrow) * rows) / max(1, num_layers)

    def price(loaded: Sequence[tuple[int, object]]) -> float:
        tokens = sum(s.num_tokens for _, s in loaded)
        compute = estimates.compute_s(mean_rows(tokens), keys)
        by_tier: dict[str, int] = {}
        for _, s in loaded:
            by_tier[s.tier] = by_tier.get(s.tier, 0) + s.num_tokens * kv_bytes_per_token
        return blend_seconds(compute, estimates.transfer_s(by_tier), num_layers, overlap)

    full_s = estimates.prefill_s(keys)
    prices = [full_s if k == 0 else price(order[:k]) for k in range(len(order) + 1)]
    lowest = len(forced)  # the explored chunks are always loaded
    best = min(range(lowest, len(prices)), key=lambda k: (prices[k], -k))
    if prices[best] > (1.0 - MARGIN) * prices[-1]:
        best = len(prices) - 1  # not clearly sooner: load every hit, as without the choice
    loaded = {i for i, _ in order[:best]}
    labels = tuple((i, s.tier, s.num_tokens, "load" if i in loaded else "recompute") for i, s in hits)
    return CostChoice(tuple(i for i, _ in hits if i not in loaded), best == 0, prices[best], prices[-1],
                      full_s, labels)


def apply_choice(plan: BlendPlan, choice: CostChoice | None) -> BlendPlan:
    """``plan`` with ``choice`` applied: its recomputed hits become computed segments
    (``hit=False``, ``recomputed=True``: still cached, so never stored again), and a
    ``full_prefill`` choice sets ``full_prefill_reason``. Unchanged for None."""
    if choice is None or (not choice.recomputed and not choice.full_prefill):
        return plan
    plan = plan.recomputing(choice.recomputed)
    if choice.full_prefill:
        plan = replace(plan, full_prefill_reason=(f"cost: full prefill {choice.full_s:.3f} s expected, "
                                                  f"loading {choice.always_load_s:.3f} s"))
    return plan
