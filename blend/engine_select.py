"""Which rows a blend computes: the engine's selection hooks (:class:`RowSelection`, a mixin of
:class:`blend.engine.BlendEngine`).

* :meth:`RowSelection._select` — at a check layer, CacheBlend's deviation ranking (Yao et al.,
  EuroSys 2025, §4.2-§4.3) of the reused rows computed there, or the rows a plan forces;
* :meth:`RowSelection._query_mode` — whether a request is ranked by the query's attention;
* :meth:`RowSelection._select_by_query` — the query probe before layer 0
  (:mod:`blend.query_selection`), and the wider set a ``query_k_deviation`` union or a
  ``query_funnel`` hands on to the check layers.

The layer loop that calls them stays in :meth:`blend.engine.BlendEngine._blend`. Axis letters
as in :mod:`blend.engine`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator
from concurrent.futures import Future

import torch

from blend import ops
from blend import query_selection as qs
from blend.plan import BlendPlan
from blend.result import BlendCounters
from blend.rows import RequestRows, to_device

#: The deviation each CacheBlend selection ranks reused rows by at a check layer.
DEVIATIONS = {"k_deviation": "k", "v_deviation": "v", "kv_deviation": "kv"}
#: Selections that probe the query's attention before layer 0 (:mod:`blend.query_selection`).
QUERY_SELECTIONS = ("query_attention", "query_k_deviation")


class RowSelection:
    """The selection hooks of :class:`blend.engine.BlendEngine` (uses its ``model``, ``scale``,
    ``process_group``, ``_ranks``, ``probe_graphs`` and ``_cached_layer``)."""

    def _select(self, plan: BlendPlan, rows: RequestRows, layer_idx: int, active: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, counters: BlendCounters,
                seed: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
                prior: torch.Tensor | None = None) -> torch.Tensor:
        """Step 4 of :meth:`_blend`, at a check layer: ``[A']`` indices into ``active`` of the rows
        computed above it: every non-reused row plus the reused rows selected by deviation of
        fresh ``k``/``v`` ``[A, H, D]`` from the cached rows of ``kv`` (scored before the fresh
        rows overwrite them), or those ``plan.forced_recompute`` names. ``seed``: ``[S]`` prompt
        rows kept ahead of any deviation (``query_k_deviation``: the probe's choice; the query
        funnel: the sinks). ``candidates``: the ascending prompt rows of the reused rows in
        ``active`` when the caller knows them (the funnel: the probe's wider set; a count known
        on the host, so no wait), ranked without thresholds (the budget holds). ``prior``:
        ``[T]`` float32 the query probe's score of every prompt row (``query_k_deviation`` with
        ``rank_fusion``): the deviation's ranking is fused with it
        (:func:`blend.query_selection.fuse_ranks`), without thresholds."""
        i = plan.check_layers.index(layer_idx)
        every_row = active.shape[0] == rows.is_reused.shape[0]  # active is every prompt row
        # reused rows computed here (host-known when every row is, or given: no wait for a count)
        if every_row:
            cand_local = rows.reused_rows
        elif candidates is not None:
            cand_local = torch.searchsorted(active, candidates)
        else:
            cand_local = torch.nonzero(rows.is_reused[active]).flatten()
        if rows.forced is not None:
            sel_local = cand_local[rows.forced[active[cand_local]]]
        else:
            scores = self._ranks.sum_(ops.deviation_of(DEVIATIONS.get(plan.selection, "k"), k, v, kv, cand_local,
                                                  active[cand_local]))  # [Rc], summed over the ranks
            fusing = prior is not None and plan.fusion_k is not None  # rank fusion (its probe may be skipped)
            fused = fusing and prior.numel() > 0
            if fused:  # rank fusion of the deviation and the probe's ranking: scores in (0, 2/(k+1)]
                scores = qs.fuse_ranks(scores, prior[active[cand_local]], plan.fusion_k)
            if seed is not None:  # query_k_deviation: the probe's rows (fusing: the sinks) rank first
                is_seed = torch.isin(active[cand_local], seed)
                if fused:  # sinks above every other row, in their fused order (a budget below them)
                    scores = torch.where(is_seed, scores + 2.0, scores)
                else:
                    scores[is_seed] = float("inf")
            ranked = candidates is not None or fusing  # a ranking without thresholds: the budget holds
            threshold = plan.recompute_thresholds[i] if plan.recompute_thresholds and not ranked else None
            sel_local = ops.select_top_ratio(scores, plan.recompute_ratios[i], threshold, cand_local,
                                             num_reused=rows.num_reused)
        counters.selected_tokens = int(sel_local.numel())
        if every_row:  # the fresh rows and the selected ones, disjoint: a size known on the host
            return torch.sort(torch.cat((rows.fresh_rows, sel_local))).values  # [A'] into active
        if candidates is not None:  # every fresh row is in active: sizes known on the host
            return torch.sort(torch.cat((torch.searchsorted(active, rows.fresh_rows), sel_local))).values
        keep = ~rows.is_reused[active]
        keep[sel_local] = True
        return torch.nonzero(keep).flatten()  # [A'] into active

    def _sink_seed(self, plan: BlendPlan, rows: RequestRows) -> torch.Tensor:
        """``[S]`` int64 prompt rows, on the model's device, of every hit chunk's first
        ``sink_tokens``: the rows a query funnel or rank fusion keeps first at its check layer."""
        sinks = qs.sink_rows_of(rows.hits, plan.sink_tokens, plan.blend_end)
        return to_device({"sinks": sinks}, self.model.device)["sinks"]

    def _query_mode(self, plan: BlendPlan, rows: RequestRows, counters: BlendCounters) -> bool:
        """Whether this request selects by query attention (:mod:`blend.query_selection`) and
        ``counters.selection``: the mode that chose its rows (``""`` without hits, ``forced``
        for ``plan.forced_recompute``); a plan that asks for ``query_attention`` without a
        query segment is ranked by K deviation (``counters.selection_fallback`` says so)."""
        by_query = plan.selection in QUERY_SELECTIONS and rows.keys and rows.forced is None
        if by_query and plan.query_rows is None:
            counters.selection_fallback, by_query = "no query segment", False
        if not rows.keys or rows.forced is not None:
            counters.selection = "forced" if rows.keys else ""
        else:
            counters.selection = plan.selection if by_query or plan.selection in DEVIATIONS else "k_deviation"
        return bool(by_query)

    def _select_by_query(self, plan: BlendPlan, rows: RequestRows, pending: dict[int, Future],
                         positions: torch.Tensor, counters: BlendCounters,
                         ) -> Generator[int, None, tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor,
                                                         torch.Tensor | None]]:
        """The query probe, before layer 0, a step per probe layer; returns ``(active, probed,
        selected, prior)``: the ``[A]`` rows the blend computes in every layer (``positions``
        itself when that is all of them), the probe's layer buffers ``{layer: [2, T_prompt, H, D]}``
        for the blend to reuse, the ``[S]`` reused rows the probe chose (ascending) and, for rank
        fusion, the probe's ``[T]`` scores (else None). ``query_attention``
        spends the whole budget here (with ``query_funnel`` F: F x it, cut at the first check layer);
        ``query_k_deviation`` half of it (``ceil(ratio / 2 * reused)``, sinks
        included) and computes every row up to the check layers, where K deviation fills the rest
        (:meth:`_select`); with ``rank_fusion`` it chooses only the sinks here and hands its
        ranking to the check layers, which fuse it with the deviation's. Ratio 0 and a budget that
        takes every reused row skip the probe (nothing to rank). ``counters.probe_s``: its compute
        time (load waits excluded).

        Raises:
            _Fallback: a cached layer the probe needs could not be read.
        """
        t0, waited = time.perf_counter(), counters.load_wait_s
        union, fused = plan.selection == "query_k_deviation", plan.fusion_k is not None
        probe_ratio = plan.recompute_ratios[0] / 2 if union and not fused else plan.funnel_ratio
        probe_plan = plan  # half the budget / the funnel's wider set (one ratio per check layer)
        if probe_ratio is not None:
            probe_plan = dataclasses.replace(plan, recompute_ratios=(probe_ratio,) * len(plan.check_layers))
        selected, probed = yield from qs.select_rows(
            self.model, probe_plan, rows, lambda i, n: self._cached_layer(rows, pending, i, counters, n), self.scale,
            self._ranks.sum_ if self.process_group is not None else None, scores_only=fused,
            graphs=self.probe_graphs if self.process_group is None else None)
        if probed:
            counters.probe_s = time.perf_counter() - t0 - (counters.load_wait_s - waited)
        if fused:  # the check layers rank every reused row by both; the sinks stay first
            return positions, probed, self._sink_seed(plan, rows), selected
        counters.selected_tokens = int(selected.numel())
        if union or selected.numel() == rows.num_reused:  # every row is computed
            return positions, probed, selected, None
        # the fresh rows and the selected reused ones (disjoint): no wait for a count
        return torch.sort(torch.cat((rows.fresh_rows, selected))).values, probed, selected, None
