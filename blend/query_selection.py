"""Query-aware selection: recompute the reused tokens the query attends to (``query_attention``).

CacheBlend ranks reused tokens by how far their cached KV deviates at a check layer
(:mod:`blend.selection`). At a 15% budget that recovers about half of the quality gap
between plain KV reuse and full prefill: tokens that deviate most are often salient but
irrelevant to the question. The 2026 papers rank by what the *query* reads instead:

* InfoFlow KV (Teng et al., arXiv 2603.05353): the attention the query's rows put on each
  context token, computed with every chunk at its real prompt position (cached K re-rotated
  there), picks the tokens that both matter and can pass information on to the answer;
* ProphetKV (arXiv 2602.02579) and QCFuse (arXiv 2606.05875): the same signal averaged over
  a few middle layers, plus the first few ("sink") tokens of every chunk (we sum over the
  layers: the same ranking as their average).

Our version (written for kvblend; :func:`select_rows`, which the engine's
:meth:`~blend.engine.BlendEngine.blend_steps` drives a step per probe layer):

1. **Probe**: the rows that are computed anyway (prefix, separators, query; not the rows of
   missed chunks, which have no cached KV and which the blend computes anyway) run through
   layers ``0 .. max(probe_layers)`` over the loaded, re-rotated cached KV of the hit chunks
   (nothing reused is recomputed); at each probe layer :func:`query_attention_mass` adds up
   the softmax weight the query's rows put on every key.
2. **Select**: :func:`select_by_query_mass` keeps the first ``sink_tokens`` rows of every hit
   chunk and fills the rest of the budget, ``ceil(ratio * reused)`` rows in all, with the
   highest-mass reused rows.
3. **Blend**: the selected rows and the always-computed rows are computed from layer 0 up over
   the cached KV of the rest; the probe's layer buffers are reused, no layer is read twice.

In this mode ``check_layers`` and ``recompute_thresholds`` are not used (the ranking happens
once, before layer 0); the ratio is the first of ``recompute_ratios``. ``query_k_deviation``
combines the probe with CacheBlend's check layers: half the budget each, or with
``rank_fusion`` one ranking by :func:`fuse_ranks` of both.

Axis letters as in :mod:`blend.protocols`; ``Q`` query rows, ``R`` reused rows.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from blend.plan import CHUNK
from blend.rows import to_device
from blend.selection import num_to_select

#: Query rows per block when summing attention weights (at most).
QUERY_BLOCK = 256
#: Attention weights ``[Hq, Qb, T]`` held at a time (float32: 64 MiB).
MASS_BLOCK_ELEMENTS = 1 << 24


def default_probe_layers(num_layers: int) -> tuple[int, ...]:
    """The layers at 1/4, 3/8 and 1/2 of the model's depth (distinct, ascending, rounded half to
    even): SmolLM2-135M's 30 layers give (8, 11, 15). Chosen against later and wider sets by
    ``kvblend bench blend`` (docs/benchmarks.md, "CPU")."""
    picks = {max(0, min(num_layers - 1, round(num_layers * f))) for f in (0.25, 0.375, 0.5)}
    return tuple(sorted(picks))


def probe_layers_for(requested: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """``requested`` (ascending, distinct) when given, else :func:`default_probe_layers`.

    Raises:
        ValueError: a requested layer outside ``[0, num_layers)``.
    """
    if not requested:
        return default_probe_layers(num_layers)
    bad = [i for i in requested if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"probe_layers {bad} outside the model's {num_layers} layers")
    return tuple(sorted(set(requested)))


def query_attention_mass(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, scale: float,
                         v: torch.Tensor | None = None, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weight the query rows put on each key, summed over query rows and heads.

    Each query row attends causally (keys at positions ``<= q_pos``); key ``t`` sits at
    position ``t``. Weights are the softmax of ``scale * q . k`` per query row and head, as the
    model's own attention computes them (GQA: query head ``h`` reads KV head ``h // (Hq/H)``),
    in float32 whatever the model's dtype. Query rows go in blocks of at most
    :data:`MASS_BLOCK_ELEMENTS` weights (``Hq * rows * T``), so a 32K-token prompt of a 7B
    model holds ~64 MiB of weights at a time.

    Args:
        q: ``[Q, Hq, D]`` the query rows' queries (after RoPE at their positions).
        q_pos: ``[Q]`` int64 their prompt positions.
        k: ``[T, H, D]`` every key of the layer (cached rows re-rotated to their positions).
        scale: the softmax scale (``D ** -0.5`` unless the model says otherwise).
        v: ``[T, H, D]`` the layer's values, or None. Given, each weight is multiplied by the
            L2 norm of the value it reads (what the token adds to the query's output; attention
            sinks draw large weights but carry near-zero values).
        row_weight: ``[Q]`` float32 factor on each query row's weights, or None (the probe's
            CUDA graphs pass 1 for real query rows and 0 for the rows padding a bucket).

    Returns:
        ``[T]`` float32; without ``v`` it sums to ``Q * Hq``.

    Raises:
        ValueError: shapes that do not fit together.
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be [Q, Hq, D] and k [T, H, D] with Hq a multiple of H; got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if q_pos.shape != (q.shape[0],) or (row_weight is not None and row_weight.shape != (q.shape[0],)):
        raise ValueError(f"q_pos (and row_weight) must be [{q.shape[0]}], got {tuple(q_pos.shape)}")
    (num_keys, num_kv_heads, head_dim), group = k.shape, q.shape[1] // k.shape[1]
    kh = k.to(torch.float32).transpose(0, 1)  # [H, T, D]
    vnorm = None if v is None else v.to(torch.float32).norm(dim=-1).transpose(0, 1)  # [H, T]
    key_pos = torch.arange(num_keys, device=k.device)
    mass = torch.zeros(num_keys, dtype=torch.float32, device=k.device)
    rows = max(1, min(QUERY_BLOCK, MASS_BLOCK_ELEMENTS // max(1, q.shape[1] * num_keys)))
    for start in range(0, q.shape[0], rows):
        qb = q[start:start + rows].to(torch.float32)  # [Qb, Hq, D]
        n = qb.shape[0]
        qg = qb.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
        logits = torch.matmul(qg, kh.transpose(1, 2)).view(num_kv_heads, group, n, num_keys) * scale
        visible = key_pos[None, :] <= q_pos[start:start + rows, None].to(k.device)  # [Qb, T]
        weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)  # [H, G, Qb, T]
        if vnorm is not None:
            weights = weights * vnorm[:, None, None, :]
        if row_weight is not None:
            weights = weights * row_weight[start:start + rows][None, None, :, None]
        mass += weights.sum(dim=(0, 1, 2))
    return mass


def chunk_budget_scores(scores: torch.Tensor, chunk_of: torch.Tensor, chunk_first: torch.Tensor,
                        power: float) -> torch.Tensor:
    """Scores whose global top-``n`` gives each hit chunk a share of the budget proportional to
    ``(its query mass) ** power``, spent on that chunk's highest-mass rows.

    The 2026 query-aware papers also budget per chunk by the query's attention to each chunk
    (the issue-38 idea "budgets per chunk"). A row of rank ``r`` (0 = most mass) inside chunk
    ``c`` is ranked by ``w_c / (r + 1)`` with ``w_c = (M_c / sum M) ** power``: a threshold ``θ``
    keeps ``w_c / θ`` rows of every chunk, so the top-``n`` is the per-chunk budget, with no
    host wait (two stable sorts on the device). The score is the log of that ratio,
    ``power * log(M_c / sum M) - log(r + 1)`` (the same order, no underflow at large powers).
    ``power`` near 0 spreads the budget evenly over the chunks; large powers fill the most-read
    chunk first, then the next.

    Args:
        scores: ``[R]`` float32 query mass of each reused row.
        chunk_of: ``[R]`` int64 index of the hit chunk holding each row, ascending (the rows
            of one chunk are contiguous in ``reused_rows``).
        chunk_first: ``[C]`` int64 index into ``[R]`` of each chunk's first row.
        power: ``> 0``.

    Returns:
        ``[R]`` float32 log-scores (finite: a chunk without mass counts as a share of 1e-30).
    """
    num_chunks = chunk_first.numel()
    chunk_mass = torch.zeros(num_chunks, dtype=torch.float64, device=scores.device).index_add_(
        0, chunk_of, scores.to(torch.float64))
    log_weight = power * torch.log((chunk_mass / chunk_mass.sum().clamp_min(1e-300)).clamp_min(1e-30))  # [C]
    by_mass = torch.sort(scores, descending=True, stable=True).indices
    grouped = by_mass[torch.sort(chunk_of[by_mass], stable=True).indices]  # chunk asc, mass desc
    rank = torch.empty_like(chunk_of)
    rank[grouped] = torch.arange(grouped.numel(), device=scores.device) - chunk_first[chunk_of[grouped]]
    return (log_weight[chunk_of] - torch.log1p(rank.to(torch.float64))).to(torch.float32)


def query_row_scores(mass: torch.Tensor, reused_rows: torch.Tensor, chunk_of: torch.Tensor | None = None,
                     chunk_first: torch.Tensor | None = None, chunk_power: float = 0.0) -> torch.Tensor:
    """``[R]`` float32 scores the probe ranks the reused rows by (higher first): their query
    mass, or with ``chunk_power > 0`` the per-chunk budget's log-scores
    (:func:`chunk_budget_scores`). Arguments as :func:`select_by_query_mass`."""
    scores = mass[reused_rows].to(torch.float32)
    if chunk_power > 0 and chunk_of is not None and chunk_first is not None and chunk_first.numel():
        scores = chunk_budget_scores(scores, chunk_of, chunk_first, chunk_power)
    return scores


def descending_ranks(scores: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 0-based rank of each score, highest first (ties in index order)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(order.numel(), device=scores.device)
    return ranks


def fuse_ranks(first: torch.Tensor, second: torch.Tensor, k: int) -> torch.Tensor:
    """Reciprocal rank fusion of two rankings of the same ``[N]`` candidates:
    ``1 / (k + rank_1) + 1 / (k + rank_2)`` with 1-based ranks, highest score first (Cormack
    et al., SIGIR 2009). The issue-38 idea "combining the probe's ranking with the
    check-layer deviation by rank fusion instead of a fixed split" (``query_k_deviation``
    with ``rank_fusion = k``): a row both rankings place high beats one that only one does,
    and neither score's scale matters. Small ``k`` trusts the top of each ranking most; large
    ``k`` flattens towards the sum of ranks. On the device, no host wait (two sorts each).

    Args:
        first, second: ``[N]`` float scores (any scale; higher ranks first).
        k: ``>= 1``.

    Returns:
        ``[N]`` float32 fused scores.
    """
    if first.shape != second.shape or first.dim() != 1:
        raise ValueError(f"two [N] rankings expected, got {tuple(first.shape)} and {tuple(second.shape)}")
    if k < 1:
        raise ValueError(f"rank fusion constant k={k} must be >= 1")
    r1 = descending_ranks(first).to(torch.float32)
    r2 = descending_ranks(second).to(torch.float32)
    return 1.0 / (k + 1.0 + r1) + 1.0 / (k + 1.0 + r2)


def select_by_query_mass(mass: torch.Tensor, reused_rows: torch.Tensor, sink_rows: torch.Tensor | None,
                         ratio: float, num_reused: int, *, sink_mask: torch.Tensor | None = None,
                         chunk_of: torch.Tensor | None = None, chunk_first: torch.Tensor | None = None,
                         chunk_power: float = 0.0) -> torch.Tensor:
    """The reused rows to recompute: sinks first, then the highest query mass, within the budget.

    Args:
        mass: ``[T]`` query attention mass per prompt row (:func:`query_attention_mass`,
            summed over the probe layers).
        reused_rows: ``[R]`` int64 rows whose KV may stay cached, ascending.
        sink_rows: int64 rows among them that are a hit chunk's first ``sink_tokens``.
        sink_mask: instead of ``sink_rows``, ``[R]`` bool on ``reused_rows``' device: which of
            them are sinks (built on the host: no device search, no wait).
        ratio: recompute ratio in ``[0, 1]``.
        num_reused: the count the ratio applies to (``R``).
        chunk_of, chunk_first, chunk_power: with ``chunk_power > 0``, the budget is shared
            out per hit chunk (:func:`chunk_budget_scores`); 0: one ranking over every row.

    Returns:
        ``[S]`` int64 rows, ascending, ``S = min(R, ceil(ratio * num_reused))``: sink rows
        count against the budget (when they alone exceed it, the sinks with most mass win).

    Raises:
        ValueError: ratio outside ``[0, 1]``.
    """
    budget = min(num_to_select(num_reused, ratio), reused_rows.numel())
    if budget == 0:
        return torch.zeros(0, dtype=torch.int64, device=reused_rows.device)
    scores = query_row_scores(mass, reused_rows, chunk_of, chunk_first, chunk_power)
    is_sink = sink_mask
    if is_sink is None and sink_rows is not None and sink_rows.numel():
        is_sink = torch.isin(reused_rows, sink_rows.to(reused_rows.device))
    if is_sink is not None:
        # Sinks outrank every other row; among themselves they keep their mass order.
        scores = torch.where(is_sink, scores + (scores.abs().max() + 1.0) * 2.0, scores)
    top = torch.topk(scores, budget, sorted=False).indices
    return reused_rows[top].sort().values


def funnel(plan) -> bool:
    """Whether ``plan`` is ``query_attention`` with ``query_funnel > 1``: the probe picks
    ``query_funnel`` times the budget (sinks included), those rows are computed up to the first
    check layer, and there the reused ones with the highest K deviation (fresh K against the
    cached, re-rotated K: CacheBlend §4.2's score) keep the budget, sinks first. CacheBlend
    filters gradually too (§4.3: a larger set at the first layers, cut at later ones); here the
    first cut is the query's attention, and the deviation drops the rows it reads whose cached
    KV is already right (the issue-38 idea of re-ranking after a partial recompute)."""
    return plan.funnel_ratio is not None


def sink_rows_of(hits, sink_tokens: int, limit: int) -> torch.Tensor:
    """int64 rows ``[s.start, s.start + sink_tokens)`` of every hit segment, below ``limit``."""
    rows = [r for s in hits for r in range(s.start, min(s.end, s.start + sink_tokens)) if r < limit]
    return torch.tensor(rows, dtype=torch.int64)


def chunk_index(hits, reused_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Host-side ``{"chunk_of": [R], "chunk_first": [C]}`` int64 for :func:`chunk_budget_scores`:
    the hit segment (ascending, non-overlapping) holding each reused row, and the index of each
    segment's first reused row (segments without one are dropped)."""
    starts = torch.tensor([s.start for s in hits], dtype=torch.int64)
    seg = torch.searchsorted(starts, reused_rows, right=True) - 1  # [R] segment index, >= 0
    ids, counts = torch.unique_consecutive(seg, return_counts=True)
    chunk_of = torch.repeat_interleave(torch.arange(ids.numel()), counts)
    return {"chunk_of": chunk_of, "chunk_first": torch.cumsum(counts, 0) - counts}


def probe_query_mass(model, token_ids: torch.Tensor, is_reused: torch.Tensor, num_query_rows: int,
                     probe_layers: tuple[int, ...], cached_layer: Callable[[int, int], torch.Tensor],
                     scale: float, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     skip: torch.Tensor | None = None, graphs=None,
                     ) -> Generator[int, None, tuple[torch.Tensor, dict[int, torch.Tensor]]]:
    """Step 1 of the module docstring: run the always-computed rows through layers
    ``0 .. max(probe_layers)`` over the cached KV and add up the query rows' attention; a
    generator that yields each probe layer's index once it is done (the engine's
    ``blend_steps`` slices the probe like the blend) and returns its result.

    ``skip`` rows (missed chunks) are left out of the probe: not computed, not attended to,
    their mass 0. A missed chunk has no cached KV, so probing through it would compute its
    rows twice (here and in the blend, which computes them anyway): on the demo's prompts
    (3.7K tokens, a 600-token miss, SmolLM2 on 2 CPU cores) that was ~1.5 s of a 7.4 s TTFT.
    The ranking of the reused rows is then the query's attention over the cached context
    alone; rows stay at their prompt positions (RoPE) and in order (causality).

    Args:
        model: the :class:`~blend.protocols.BlendModel`.
        token_ids: ``[T]`` int64 the whole prompt, query included.
        is_reused: ``[T]`` bool rows whose KV stays cached in the probe (the hit rows), best
            on the CPU: the probe's index sets are built there and copied once (a device
            tensor is brought to the host first, a wait).
        num_query_rows: the query rows are the last ``num_query_rows`` of the prompt (never
            reused).
        probe_layers: ascending layer indices whose attention is summed.
        cached_layer: ``cached_layer(layer_idx, T)`` gives that layer's ``[2, T, H, D]`` buffer
            with the hit rows filled (raises to abandon the blend).
        scale: softmax scale.
        reduce: sums a ``[T]`` tensor over tensor-parallel ranks (each holds its own heads).
        skip: ``[T]`` bool rows to leave out (never reused rows nor query rows), or None; best
            on the CPU, as ``is_reused``.
        graphs: a :class:`blend.probe_graphs.ProbeGraphs` whose prepared bucket, when there is
            one for this probe's rows and keys, replays each layer's work (the same results);
            None or no bucket: every layer runs eagerly.
        Each weight is multiplied by the norm of the value it reads (:func:`query_attention_mass`).

    Returns:
        ``(mass [T] float32, buffers)``: ``buffers[l]`` is layer ``l``'s buffer with the
        probe's fresh rows written, for the blend pass to reuse.
    """
    from blend.ops import causal_attention

    num_tokens, device = token_ids.shape[0], token_ids.device
    is_reused = is_reused.cpu()  # index sets come from the plan: built on the host, one copy
    skip = None if skip is None else skip[:num_tokens].cpu()
    kept = None  # [T'] prompt rows the probe keeps (None: all), ascending
    if skip is not None and bool(skip.any()):
        kept = torch.nonzero(~skip).flatten()
    # probe coordinates: index i is prompt row kept[i] (or i); causal order is kept
    probe_reused = is_reused if kept is None else is_reused[kept]
    active = torch.nonzero(~probe_reused).flatten()  # [A] ascending; the query rows are its tail
    host = {"active": active, "rows": active if kept is None else kept[active]}  # rows: prompt rows
    if kept is not None:
        host["kept"] = kept
    dev = to_device(host, device)
    active, active_rows, kept = dev["active"], dev["rows"], dev.get("kept")
    query = slice(active.numel() - num_query_rows, active.numel())
    hidden, residual = model.embed(token_ids[active_rows]), None
    mass = torch.zeros(num_tokens, dtype=torch.float32, device=token_ids.device)
    buffers: dict[int, torch.Tensor] = {}
    last = probe_layers[-1]
    num_keys = num_tokens if kept is None else kept.numel()
    bucket = None if graphs is None else graphs.ready(active.numel(), num_keys, probe_layers)
    if bucket is not None:  # each layer replayed from the bucket's graph
        graphs.begin(bucket, hidden, active_rows, active, num_query_rows, num_keys)
        try:
            for layer_idx in range(last + 1):
                full = cached_layer(layer_idx, num_tokens)
                k, v = graphs.layer(bucket, layer_idx, full if kept is None else full[:, kept])
                full[0, active_rows] = k
                full[1, active_rows] = v
                buffers[layer_idx] = full
                yield layer_idx
            if kept is None:
                mass += graphs.mass(bucket)
            else:
                mass[kept] += graphs.mass(bucket)
        finally:  # done, failed (a layer that cannot be read) or closed mid-probe
            graphs.release(bucket)
        return (mass if reduce is None else reduce(mass)), buffers
    for layer_idx in range(last + 1):
        full = cached_layer(layer_idx, num_tokens)
        kv = full if kept is None else full[:, kept]  # [2, T', H, D]
        q, k, v, residual = model.qkv(layer_idx, hidden, residual, active_rows)
        kv[0, active] = k
        kv[1, active] = v
        if kept is not None:  # the fresh rows into the buffer the blend reuses
            full[:, active_rows] = kv[:, active]
        buffers[layer_idx] = full
        if layer_idx in probe_layers:
            layer_mass = query_attention_mass(q[query], active[query], kv[0], scale, kv[1])
            if kept is None:
                mass += layer_mass
            else:
                mass[kept] += layer_mass
        if layer_idx < last:
            attn_out = causal_attention(q, kv[0], kv[1], active, scale)
            hidden, residual = model.finish_layer(layer_idx, attn_out, residual)
        yield layer_idx
    if reduce is not None:
        mass = reduce(mass)
    return mass, buffers


def select_rows(model, plan, rows, cached_layer: Callable[[int, int], torch.Tensor], scale: float,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, *, scores_only: bool = False,
                graphs=None) -> Generator[int, None, tuple[torch.Tensor, dict[int, torch.Tensor]]]:
    """Steps 1-2 of the module docstring for one request, a step per probe layer: returns
    ``(selected, probed)``, the ``[S]`` int64 reused rows to recompute and the probe's layer
    buffers (empty when the probe was skipped: ratio 0, or a budget that takes every reused
    row — nothing to rank).

    Args:
        model: the :class:`~blend.protocols.BlendModel`.
        plan: the :class:`~blend.plan.BlendPlan` (``query_rows`` must not be None).
        rows: its :class:`~blend.rows.RequestRows`.
        cached_layer, scale, reduce, graphs: as :func:`probe_query_mass`.
        scores_only: return the probe's ranking instead of a selection: ``selected`` is then
            ``[T]`` float32 over the prompt rows, :func:`query_row_scores` on the reused rows
            and ``-inf`` elsewhere (rank fusion ranks it at the check layers); with the probe
            skipped it is ``[0]``.
    """
    device, num_tokens = rows.is_reused.device, plan.blend_end
    ratio = plan.recompute_ratios[0]
    reused_rows = rows.reused_rows  # [R]
    budget = num_to_select(rows.num_reused, ratio)
    if budget == 0 or budget >= reused_rows.numel():
        if scores_only:
            return torch.zeros(0, dtype=torch.float32, device=device), {}
        return reused_rows[:budget], {}
    start, end = plan.query_rows
    # host side: which rows are reused, missed, sinks (from the plan); then one copy
    is_reused = torch.zeros(end, dtype=torch.bool)
    is_reused[:num_tokens] = rows.is_reused_host
    missed = torch.zeros(end, dtype=torch.bool)
    for seg in plan.segments:
        if seg.kind == CHUNK and not seg.hit and seg.start < num_tokens:
            missed[seg.start:min(seg.end, num_tokens)] = True
    missed &= ~is_reused
    sinks = sink_rows_of(rows.hits, plan.sink_tokens, num_tokens)
    reused_host = torch.nonzero(rows.is_reused_host).flatten()
    host = {"ids": torch.tensor(plan.token_ids[:end], dtype=torch.int64), "is_sink": torch.isin(reused_host, sinks)}
    if plan.chunk_budget_power > 0:
        host.update(chunk_index(rows.hits, reused_host))
    dev = to_device(host, device)
    layers = probe_layers_for(plan.probe_layers, model.spec.num_layers)
    mass, probed = yield from probe_query_mass(model, dev["ids"], is_reused, end - start, layers, cached_layer,
                                               scale, reduce, skip=missed, graphs=graphs)
    if scores_only:
        prior = torch.full((num_tokens,), float("-inf"), dtype=torch.float32, device=device)
        prior[reused_rows] = query_row_scores(mass, reused_rows, dev.get("chunk_of"), dev.get("chunk_first"),
                                              plan.chunk_budget_power)
        return prior, probed
    return select_by_query_mass(mass, reused_rows, None, ratio, rows.num_reused, sink_mask=dev["is_sink"],
                                chunk_of=dev.get("chunk_of"), chunk_first=dev.get("chunk_first"),
                                chunk_power=plan.chunk_budget_power), probed
