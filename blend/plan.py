"""``BlendPlan``: one immutable description of how a request is blended.

A blend prompt, as token ids (ruler shows one request; ``|`` are segment bounds)::

    | sys prompt | sep | segment A (hit) | sep | segment B (miss) | sep | segment C (hit) | sep | query |
    0            s0    a0              a1     b0               b1     c0               c1          q0     T
                                                                                         blend_end = q0

* ``prefix`` (the system prompt, with BOS if any) and separators are always computed;
* hit segments are loaded and re-rotated from their stored positions to their new ones,
  then only the tokens selected at the check layer(s) are recomputed;
* missed segments are computed (and their canonical KV stored afterwards);
* the ``query`` (everything after the last separator) is left to the serving engine when
  ``blend_end < T`` (the vLLM connector), or computed by the blend engine.

Bookkeeping only: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tiers.keys import ChunkKey

PREFIX = "prefix"
SEPARATOR = "sep"
CHUNK = "chunk"
QUERY = "query"


@dataclass(frozen=True)
class Segment:
    """A span ``[start, end)`` of the prompt's token ids.

    Attributes:
        kind: ``prefix`` | ``sep`` | ``chunk`` | ``query``.
        key: the chunk's position-independent key (``chunk`` only).
        hit: whether the chunk's KV is cached (``chunk`` only).
        stored_positions: positions the cached K was rotated at (hits only; canonical
            chunks are stored at ``0..n-1``).
        tier: the tier that answered the lookup (hits only; e.g. ``host``, ``disk``).
        recomputed: cached, but computed like a miss because loading it was priced slower
            (:func:`blend.cost.apply_choice`; then ``hit`` is False and ``tier`` kept). Not a
            miss: it is never stored again.
    """

    kind: str
    start: int
    end: int
    key: ChunkKey | None = None
    hit: bool = False
    stored_positions: tuple[int, ...] = ()
    tier: str = ""
    recomputed: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BlendPlan:
    """How one request is blended (built by :func:`blend.planner.make_plan`).

    Attributes:
        token_ids: the whole prompt.
        segments: spans covering ``[0, len(token_ids))`` in order, no overlap.
        check_layers: 0-based layers where tokens are (re)selected.
        recompute_ratios: one per check layer.
        recompute_thresholds: empty, or one per check layer.
        blend_end: tokens ``[0, blend_end)`` are produced by the blend engine.
        full_prefill_reason: not None when the request must not be blended (the reason is
            logged and counted), e.g. fewer than ``min_tokens`` reusable tokens.
        forced_recompute: optional injected recompute set (prompt token indices) used by
            tests to compare adapters; None in serving.
        selection: how reused tokens are chosen (:data:`blend.config.SELECTIONS`).
        probe_layers: ``query_attention``: layers whose query attention is summed (empty:
            the engine's default for the model's depth).
        sink_tokens: ``query_attention``: leading tokens of every hit chunk always recomputed.
        chunk_budget_power: the query probe (``query_attention``, ``query_k_deviation``): 0, one
            ranking over every reused row; ``> 0``,
            each hit chunk's share of the budget grows as its query mass to this power.
        query_funnel: ``query_attention``: 1, the probe's rows are final; ``> 1``, the probe
            picks this many times the budget and the first check layer keeps the budget by K
            deviation (:func:`blend.query_selection.funnel`).
        rank_fusion: ``query_k_deviation``: 0, the probe picks half the budget and K deviation
            the rest; ``k > 0``, the check layers rank by reciprocal rank fusion of the probe's
            and the deviation's rankings (:func:`blend.query_selection.fuse_ranks`).
    """

    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    check_layers: tuple[int, ...]
    recompute_ratios: tuple[float, ...]
    recompute_thresholds: tuple[float, ...] = ()
    blend_end: int = 0
    full_prefill_reason: str | None = None
    forced_recompute: tuple[int, ...] | None = field(default=None, compare=False)
    selection: str = "k_deviation"
    probe_layers: tuple[int, ...] = ()
    sink_tokens: int = 0
    chunk_budget_power: float = 0.0
    query_funnel: float = 1.0
    rank_fusion: int = 0

    def __post_init__(self) -> None:
        pos = 0
        for seg in self.segments:
            if seg.start != pos or seg.end < seg.start:
                raise ValueError(f"segments must tile the prompt in order: {seg} at {pos}")
            pos = seg.end
        if pos != len(self.token_ids):
            raise ValueError(f"segments cover {pos} of {len(self.token_ids)} tokens")
        if not 0 <= self.blend_end <= len(self.token_ids):
            raise ValueError(f"blend_end={self.blend_end} outside 0..{len(self.token_ids)}")
        if len(self.recompute_ratios) != len(self.check_layers):
            raise ValueError("one recompute ratio per check layer")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens={self.sink_tokens} must be >= 0")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def blend(self) -> bool:
        return self.full_prefill_reason is None

    @property
    def hit_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind == CHUNK and s.hit)

    @property
    def funnel_ratio(self) -> float | None:
        """The query funnel's wider share (``min(1, ratio x query_funnel)``) that the probe
        picks and the first check layer cuts to the budget, or None when the plan has no
        funnel (:func:`blend.query_selection.funnel`)."""
        if self.selection != "query_attention" or self.query_funnel <= 1.0 or not self.check_layers:
            return None
        return min(1.0, self.recompute_ratios[0] * self.query_funnel)

    @property
    def fusion_k(self) -> int | None:
        """RRF's constant when ``query_k_deviation`` fuses the probe's ranking with the check
        layers' deviation (``rank_fusion > 0``), else None."""
        if self.selection != "query_k_deviation" or self.rank_fusion <= 0 or not self.check_layers:
            return None
        return self.rank_fusion

    @property
    def query_rows(self) -> tuple[int, int] | None:
        """``(start, end)`` of the query segment (the prompt's last segment after a
        separator), or None when the prompt has none."""
        last = self.segments[-1] if self.segments else None
        if last is None or last.kind != QUERY or last.num_tokens == 0:
            return None
        return last.start, last.end

    @property
    def missed_segments(self) -> tuple[Segment, ...]:
        """Chunks the cache does not hold (computed, and stored afterwards); a hit the plan
        recomputes (``recomputed``) is not one."""
        return tuple(s for s in self.segments if s.kind == CHUNK and not s.hit and not s.recomputed)

    @property
    def num_reused_tokens(self) -> int:
        return sum(s.num_tokens for s in self.hit_segments)

    def recomputing(self, indices) -> BlendPlan:
        """This plan with the hit chunks at ``indices`` (into :attr:`segments`) computed
        instead of loaded (``hit=False, recomputed=True``: still cached, never stored again)."""
        chosen = set(indices)
        if not chosen:
            return self
        return replace(self, segments=tuple(replace(s, hit=False, recomputed=True) if i in chosen else s
                                            for i, s in enumerate(self.segments)))
