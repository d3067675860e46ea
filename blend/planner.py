"""Build a :class:`~blend.plan.BlendPlan`: keys per chunk segment, one batched lookup, decision.

::

    | prefix | sep | chunk A (hit) | sep | chunk B (miss) | sep | chunk C (hit) | sep | query |
                                                                                      ^ blend_end
                                                     (query_to_engine=False: vLLM computes the query)

The spans decide what is a chunk: the vLLM scheduler passes the first segment as a chunk too
(:func:`blend.segments.first_segment_as_chunk`), so it is looked up and, missed, stored; spans
straight from :func:`blend.segments.find_segments` keep it a prefix (always computed).
Hits anywhere are used: a missed chunk does not stop the reuse of later ones
(../shared/cases/hits-after-a-miss.md). The ``min_tokens`` floor applies to the whole
prompt's reusable tokens, not to each segment (../shared/cases/separator-edges.md).
When the request must not be blended the plan still carries its segments and keys (so the
caller can store missed chunks) and says why in ``full_prefill_reason``.

Bookkeeping only: no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from blend.config import BlendConfig
from blend.plan import CHUNK, QUERY, SEPARATOR, BlendPlan, Segment
from blend.protocols import KVSource
from tiers.keys import segment_key

log = logging.getLogger(__name__)


def make_plan(token_ids: Sequence[int], spans: Sequence[tuple[str, int, int]], namespace_digest: str,
              source: KVSource | None, config: BlendConfig, *,
              query_to_engine: bool = False, tenant: str = "") -> BlendPlan:
    """Plan one request.

    Args:
        token_ids: the whole prompt.
        spans: ``(kind, start, end)`` tiling the prompt (from :func:`blend.segments.find_segments`
            or :func:`blend.segments.build_blend_prompt`).
        namespace_digest: :meth:`tiers.keys.Namespace.digest` of the served model.
        source: where cached chunks are looked up (one batched ``lookup``); None = unavailable.
        config: check layers, ratios, thresholds, ``min_tokens``.
        query_to_engine: True when the blend engine computes the whole prompt (benchmark,
            tests); False when the serving engine computes the query, so ``blend_end`` is the
            query's start (at most ``len(token_ids) - 1``: vLLM must compute >= 1 token).
        tenant: the request's tenant (:func:`tiers.keys.segment_key`): its chunks are keyed apart.

    Returns:
        The plan. ``full_prefill_reason`` is set when blending is off, the prompt has no
        separator, the source is unavailable or raised, or fewer than ``config.min_tokens``
        tokens would be reused (e.g. ``"fewer than min_tokens reusable tokens: 120 < 256"``).

    Raises:
        ValueError: empty prompt, or spans that do not tile it.
    """
    token_ids = tuple(int(t) for t in token_ids)
    n = len(token_ids)
    if n == 0:
        raise ValueError("cannot plan an empty prompt")
    chunk_spans = [(s, e) for kind, s, e in spans if kind == CHUNK and e > s]
    keys = [segment_key(namespace_digest, token_ids[s:e], tenant) for s, e in chunk_spans]
    reason: str | None = None
    metas: list = [None] * len(keys)
    if not config.enable_blending:
        reason = "blending disabled"
    elif not any(kind == SEPARATOR for kind, _, _ in spans):
        reason = "no separator"
    elif source is None:
        reason = "source unavailable"
    elif keys:
        try:
            metas = list(source.lookup(keys))
        except Exception as e:  # a dead cache is a miss, never a failed request
            log.warning("kv source lookup failed (%s: %s): full prefill", type(e).__name__, e)
            metas, reason = [None] * len(keys), "source unavailable"
        if len(metas) != len(keys):
            log.warning("kv source answered %d of %d keys: full prefill", len(metas), len(keys))
            metas, reason = [None] * len(keys), "source unavailable"
    segments: list[Segment] = []
    chunk_i = 0
    for kind, s, e in spans:
        if e <= s:
            continue
        if kind == CHUNK:
            meta, key = metas[chunk_i], keys[chunk_i]
            chunk_i += 1
            hit = meta is not None and meta.num_tokens == e - s and len(meta.positions) == e - s
            segments.append(Segment(CHUNK, s, e, key=key, hit=hit,
                                    stored_positions=tuple(meta.positions) if hit else (),
                                    tier=str(getattr(meta, "tier", "") or "") if hit else ""))
        else:
            segments.append(Segment(kind, s, e))
    query_start = next((s.start for s in segments if s.kind == QUERY), n)
    blend_end = n if query_to_engine else min(query_start, n - 1)
    reusable = sum(s.num_tokens for s in segments if s.kind == CHUNK and s.hit and s.end <= blend_end)
    if reason is None and reusable < config.min_tokens:
        reason = f"fewer than min_tokens reusable tokens: {reusable} < {config.min_tokens}"
    thresholds = tuple(config.threshold_for(i) for i in range(len(config.check_layers))) \
        if config.recompute_thresholds else ()
    plan = BlendPlan(
        token_ids=token_ids, segments=tuple(segments), check_layers=tuple(config.check_layers),
        recompute_ratios=tuple(config.ratio_for(i) for i in range(len(config.check_layers))),
        recompute_thresholds=thresholds, blend_end=blend_end, full_prefill_reason=reason,
        selection=config.selection, probe_layers=tuple(config.probe_layers), sink_tokens=config.sink_tokens,
        chunk_budget_power=config.chunk_budget_power, query_funnel=config.query_funnel,
        rank_fusion=config.rank_fusion)
    log.debug("blend plan: %d tokens, %d chunk segments, %d hits, %d reusable tokens, blend_end=%d, "
              "full_prefill_reason=%s", n, len(keys), len(plan.hit_segments), reusable, blend_end, reason)
    return plan
