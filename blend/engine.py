"""The CacheBlend engine: layer-by-layer blending of cached chunk KV with selective recompute.

Algorithm (Yao et al., "CacheBlend", EuroSys 2025, §4.2-§4.3 selection, §5 pipelining)::

    | prefix | sep | chunk A (hit) | sep | chunk B (miss) | sep | chunk C (hit) | sep | query |
      always   always   reused         always   always        always   reused       always  (when blended)

    layers 0 .. c1-1   every row computed (fresh KV for all tokens, as full prefill)
    layer c1 (check)   every row computed; reused rows scored by ||K_fresh - K_cached||^2
                       (summed over KV heads); the top ratio (minus those under the threshold)
                       plus the always-computed rows continue; the layer's KV is fresh
    layers > c1        only continuing rows are computed; their fresh KV is scattered into the
                       cached, re-rotated KV of the rest; each row attends causally over it
    later check layer  the continuing reused rows are re-scored and cut to that layer's ratio

That is the plan's ``selection`` ``k_deviation`` (``v_deviation``, ``kv_deviation``: V or K+V
deviation instead). With ``query_attention`` the rows are chosen once, before layer 0, by a
probe of the query's attention over the cached context (:mod:`blend.query_selection`); then
no layer computes every row and the check layers are not used. ``query_k_deviation`` is
their union within the same budget: the probe chooses half of it before layer 0, every row
is computed up to the check layers as in CacheBlend, and K deviation fills the rest there;
with ``rank_fusion`` the check layers rank by the fusion of both rankings instead
(:func:`blend.query_selection.fuse_ranks`).
``query_attention`` with ``query_funnel > 1`` probes a wider set and cuts it to the budget by
K deviation at the first check layer (:func:`blend.query_selection.funnel`).
Selection is one hook (:mod:`blend.engine_select`), ``_select`` at a check layer or
``_select_by_query`` before the layer loop; the loop is the same in every mode.

Every cached layer the request needs (the first check layer and up) is requested from the
:class:`KVSource` in one call when the blend starts; the source moves them in the background
while the engine computes, so loading overlaps compute (§5), and on CUDA the compute stream
waits on each layer's copy event rather than the host waiting for the copy. Layers below the
first check layer never need the cache. A chunk whose layer cannot be read (None
from the source, wrong shape) turns the request into full prefill, never a failure.

Per layer above the first check layer the engine allocates one ``[2, T, H, D]`` buffer, puts
the hit chunks into their rows (K re-rotated in place by :func:`blend.ops.rerotate_k_`), scores and
selects at check layers straight from that buffer (:func:`blend.ops.deviation_scores`,
:func:`blend.ops.select_top_ratio`), writes the computed rows over it and attends over it
(:func:`blend.ops.causal_attention`; on CUDA with one block mask built at the last check layer). That
buffer is the layer's result: no other pass over the layer's KV. The fast paths dispatch to
Triton/FlexAttention on CUDA and to the plain-torch references elsewhere (issue 9: the engine
was CPU-bound below 16K tokens on an H200, ~2.5 ms of launches and copies per layer).
With a ``process_group`` (tensor parallelism by KV heads, issue 10) the check layer's scores are
summed over the ranks before top-k, so every rank selects the same rows.

Axis letters: T prompt tokens blended (``blend_end``), Rh rows of hit chunks, Rc reused rows
computed at a check layer, A computed rows, H KV heads, Hq query heads, D head dim, E hidden, V vocab.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future

import torch

from blend import ops
from blend import query_selection as qs
from blend.config import DEFAULT_LOAD_TIMEOUT_S
from blend.cost import kv_bytes_per_token
from blend.engine_select import QUERY_SELECTIONS, RowSelection
from blend.ops import causal_attention
from blend.plan import CHUNK, BlendPlan
from blend.protocols import BlendModel, KVSource
from blend.ranks import RankGroup
from blend.result import BlendCounters, BlendResult
from blend.rope import check_blendable, inv_freq_for
from blend.rows import (
    RequestRows,
    check_layer_batch,
    fit_to_source,
    layer_result,
    place_cached,
    recompute_lost,
    request_rows,
    start_fetch,
    unreadable_hits,
)
from blend.steps import run_steps, timed_steps, wait_for_device

log = logging.getLogger(__name__)


OnLayer = Callable[[int, torch.Tensor], None]


class _Fallback(Exception):
    """A hit chunk's layer could not be read: recompute the request (``lost``: the keys of the
    chunks to blame, when some are; ``()`` when the whole layer failed)."""

    def __init__(self, why: str, lost: tuple = ()) -> None:
        super().__init__(why)
        self.lost = lost


class BlendEngine(RowSelection):
    """Blends a :class:`BlendPlan` with a :class:`BlendModel` and a :class:`KVSource`.

    Args:
        model: the model, cut at CacheBlend's seams.
        source: cached chunk KV (None: every request is full prefill).
        process_group: the tensor-parallel group when the model is sharded by KV heads (each
            rank blends its own heads, from chunks stored under its own rank's namespace).
            The per-token scores of a check layer are summed over the group
            (``all_reduce``) before top-k, so every rank selects the same rows; a layer that
            one rank cannot read sends every rank to full prefill together. Every rank must
            call :meth:`blend` with the same plan segments, hits and ratios. Reductions the
            model itself needs (row-parallel projections) are the model adapter's business.
            None: no tensor parallelism.
        load_timeout_s: longest wait for one cached layer once the blend needs it; past it the
            request is recomputed (``BlendConfig.load_timeout_s``, issue 20).
        probe_graphs: a :class:`blend.probe_graphs.ProbeGraphs` of this model: the query probe
            replays the layers of its prepared buckets (not with a ``process_group``); None:
            the probe runs eagerly.

    Re-rotation of cached K uses the model's ``inv_freq`` ``[D/2]`` when it has one, else
    :func:`blend.rope.inv_freq_for` of its spec (what :meth:`BlendModel.rotate_k` uses).

    The engine keeps no per-request state between calls and owns no threads: the source
    reads the layers it was asked for in the background.
    """

    def __init__(self, model: BlendModel, source: KVSource | None = None, *,
                 process_group: torch.distributed.ProcessGroup | None = None,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, probe_graphs=None) -> None:
        self.model = model
        self.source = source
        self.spec = model.spec
        self.scale = float(getattr(model, "scale", self.spec.head_dim ** -0.5))
        self.process_group = process_group
        self.load_timeout_s = load_timeout_s
        self.probe_graphs = probe_graphs
        self._ranks = RankGroup(process_group, model.device)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ public

    def close(self) -> None:
        """Nothing to release (the engine owns no threads; the source does). Idempotent."""

    def prefill(self, token_ids: Sequence[int], *, want_logits: bool = True,
                on_layer: OnLayer | None = None) -> BlendResult:
        """Full prefill of ``token_ids`` through the model protocol (the oracle; and the
        canonical KV of a chunk: the chunk alone at positions 0..n-1, no BOS).

        Raises:
            ValueError: empty input, longer than the context window, or a sliding window
                shorter than the input.
        """
        counters = BlendCounters(computed_tokens=len(token_ids))
        spent = [0.0]
        steps = self._full(list(token_ids), want_logits, on_layer, counters)
        result = run_steps(timed_steps(steps, spent, self._device_done))
        counters.compute_s = spent[0]
        return result

    def blend(self, plan: BlendPlan, *, want_logits: bool = True,
              on_layer: OnLayer | None = None) -> BlendResult:
        """Blend tokens ``[0, plan.blend_end)`` per the plan.

        ``on_layer(layer_idx, kv)`` (kv ``[2, T, H, D]``) is called as soon as each layer's
        final KV is known. A hit chunk whose layer cannot be read (found at lookup, gone or
        malformed since) is computed instead: the request is blended again, once, with it as a
        miss (``counters.lost_segments``; not with tensor parallelism, whose ranks would have to
        agree). If ``plan.full_prefill_reason`` is set, no hit would be left, or a whole layer
        cannot be fetched, the engine computes full prefill of ``[0, blend_end)`` instead and
        says so in the counters (``num_hit_segments=0``, ``reused_tokens=0``,
        ``full_prefill_reason``). After either, ``on_layer`` is called again for every layer
        (the last call per layer wins).

        Raises:
            ValueError: ``blend_end == 0``, a prompt longer than the context window, a check
                or probe layer outside the model, RoPE that is not linear in position or a sliding
                window shorter than the prompt (see :func:`blend.rope.check_blendable`).
        """
        return run_steps(self.blend_steps(plan, want_logits=want_logits, on_layer=on_layer))

    def blend_steps(self, plan: BlendPlan, *, want_logits: bool = True,
                    on_layer: OnLayer | None = None) -> Generator[int, None, BlendResult]:
        """:meth:`blend` one layer at a time, for a caller that interleaves other work (vLLM's
        async-load path: a long blend sliced across engine steps so that other requests keep
        decoding).

        Yields the index of each layer once its ``on_layer`` call returned (after a
        mid-request fallback or a blend again without a lost chunk the layers count from 0 again); returns the
        :class:`BlendResult` (``StopIteration.value``; :func:`run_steps` drives it to the
        end; a ``query_attention`` request first yields once per probe layer, before any
        ``on_layer`` call). Drive it with gradients off (``torch.no_grad``/``inference_mode`` around each
        ``next``) and on one thread at a time; cached layers keep loading in the source
        between steps. ``close()`` abandons the request (pending reads are cancelled). ``counters.compute_s`` counts only the time spent inside steps.

        Raises:
            ValueError: as :meth:`blend`, from the first ``next``.
        """
        num_tokens = plan.blend_end
        token_ids = list(plan.token_ids[:num_tokens])
        chunks = [s for s in plan.segments if s.kind == CHUNK and s.start < num_tokens]
        counters = BlendCounters(num_segments=len(chunks))
        spent = [0.0]
        reason = plan.full_prefill_reason
        if reason is None and self.source is None:
            reason = "source unavailable"
        if reason is None:
            self._check_length(num_tokens)
            check_blendable(self.spec, num_tokens)
            bad = [c for c in plan.check_layers if not 0 <= c < self.spec.num_layers]
            if bad:
                raise ValueError(f"check_layers {bad} outside the model's {self.spec.num_layers} layers")
            if plan.selection in QUERY_SELECTIONS:
                qs.probe_layers_for(plan.probe_layers, self.spec.num_layers)  # raises when outside
            plan = fit_to_source(plan, self.source, kv_bytes_per_token(self.spec, torch.finfo(self.model.dtype).bits // 8),
                                 counters)
            reason = plan.full_prefill_reason
        lost: tuple = ()  # keys of the hit chunks computed after they could not be read
        while reason is None:
            try:
                steps = self._blend(plan, want_logits, on_layer, counters)
                result = yield from timed_steps(steps, spent, self._device_done)
                counters.compute_s = spent[0] - counters.load_wait_s
                counters.lost_segments, counters.lost_keys = len(lost), lost
                if lost:  # the chunks were fetched twice: no clean transfer sample
                    counters.transfer_s, counters.transfer_busy_s = 0.0, None
                self._log(counters)
                return result
            except _Fallback as e:
                reason = str(e)
                # blend again once, the lost chunks computed (no rank to agree with; a second
                # loss is full prefill: at most two blends' worth of load waits)
                again = None if self.process_group is not None or lost else recompute_lost(plan, e.lost)
                if again is not None:
                    log.info("%s: blending again with the lost chunk(s) computed", reason)
                    lost += tuple(s.key for s in plan.hit_segments if s.key in e.lost)
                    counters = BlendCounters(num_segments=len(chunks), load_wait_s=counters.load_wait_s,
                                             unfit_segments=counters.unfit_segments, unfit_keys=counters.unfit_keys)
                    plan, reason = again, None
        counters = BlendCounters(num_segments=len(chunks), computed_tokens=num_tokens,
                                 load_wait_s=counters.load_wait_s, full_prefill_reason=reason,
                                 lost_segments=len(lost), lost_keys=lost)
        steps = self._full(token_ids, want_logits, on_layer, counters)
        result = yield from timed_steps(steps, spent, self._device_done)
        counters.compute_s = spent[0] - counters.load_wait_s
        self._log(counters)
        return result

    # ----------------------------------------------------------------- helpers

    def _device_done(self) -> None:
        """The end of a request's timed work: :func:`blend.steps.wait_for_device` on the model's."""
        wait_for_device(self.model.device)

    def _check_length(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            raise ValueError("nothing to compute: 0 tokens")
        if self.spec.max_position and num_tokens > self.spec.max_position:
            raise ValueError(f"prompt of {num_tokens} tokens exceeds the model's context window "
                             f"({self.spec.max_position} positions)")

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """Inverse RoPE frequencies ``[D/2]`` float32 on ``device``, built once per device."""
        inv = self._inv_freq.get(device)
        if inv is None:
            own = getattr(self.model, "inv_freq", None)
            inv = (own if own is not None else inv_freq_for(self.spec)).to(device, torch.float32)
            self._inv_freq[device] = inv
        return inv

    def _log(self, c: BlendCounters) -> None:
        log.debug("blend: segments=%d hits=%d reused=%d computed=%d selected=%d "
                  "recomputed_per_layer=%s load_wait_s=%.4f compute_s=%.4f full_prefill_reason=%s",
                  c.num_segments, c.num_hit_segments, c.reused_tokens, c.computed_tokens,
                  c.selected_tokens, c.recomputed_tokens_per_layer, c.load_wait_s, c.compute_s,
                  c.full_prefill_reason)

    def _full(self, token_ids: list[int], want_logits: bool, on_layer: OnLayer | None,
              counters: BlendCounters) -> Generator[int, None, BlendResult]:
        """Causal prefill of every row in every layer (a step per layer, see :meth:`blend_steps`)."""
        num_tokens = len(token_ids)
        self._check_length(num_tokens)
        if self.spec.sliding_window is not None and self.spec.sliding_window < num_tokens:
            raise ValueError(f"sliding_window={self.spec.sliding_window} is shorter than the "
                             f"{num_tokens}-token input; this engine computes full causal attention only")
        model = self.model
        device = model.device
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        positions = torch.arange(num_tokens, device=device)
        hidden, residual = model.embed(ids), None  # [T, E]
        kv_layers: list[torch.Tensor] = []
        for layer_idx in range(self.spec.num_layers):
            q, k, v, residual = model.qkv(layer_idx, hidden, residual, positions)
            attn_out = causal_attention(q, k, v, None, self.scale)  # [T, Hq * D]
            hidden, residual = model.finish_layer(layer_idx, attn_out, residual)
            kv = torch.stack((k, v))  # [2, T, H, D]
            kv_layers.append(kv)
            counters.recomputed_tokens_per_layer.append(num_tokens)
            if on_layer is not None:
                on_layer(layer_idx, kv)
            yield layer_idx
        logits = model.logits(hidden[-1:], residual[-1:])[0] if want_logits else None
        return BlendResult(kv_layers, logits, positions.clone(), counters)

    def _cached_layer(self, rows: RequestRows, pending: dict[int, Future], layer_idx: int,
                      counters: BlendCounters, num_rows: int | None = None) -> torch.Tensor:
        """Step 3 of :meth:`_blend`: this layer's KV buffer ``[2, T, H, D]`` (``num_rows``
        rows when given, else ``T``). Hit rows hold the cached K (re-rotated to the prompt
        positions) and V; other rows are uninitialized (every one of them is computed, and the
        caller writes it over the buffer).

        Raises:
            _Fallback: a hit chunk's layer could not be read (here or on another rank).
        """
        spec, model = self.spec, self.model
        num_rows = rows.is_reused.shape[0] if num_rows is None else num_rows
        kv = torch.empty((2, num_rows, spec.num_kv_heads, spec.head_dim), dtype=model.dtype,
                         device=model.device)  # [2, T, H, D]
        if not rows.keys:
            return kv
        t0 = time.perf_counter()
        got = layer_result(pending.pop(layer_idx, None), layer_idx, self.load_timeout_s)
        counters.load_wait_s += time.perf_counter() - t0
        why = check_layer_batch(rows, got, spec, layer_idx)
        if not self._ranks.all_ok(why is None):
            raise _Fallback(why or f"layer {layer_idx} could not be read on another tensor-parallel rank",
                            unreadable_hits(rows, got, spec) if why else ())
        place_cached(kv, rows, got)
        return kv

    def _blend(self, plan: BlendPlan, want_logits: bool, on_layer: OnLayer | None,
               counters: BlendCounters) -> Generator[int, None, BlendResult]:
        """The blend itself, a step per layer (see the module docstring): request rows, then per
        layer the fetch ahead, the cached layer, the selection at check layers and the
        attention of the computed rows over the mixed KV."""
        model, num_tokens = self.model, plan.blend_end
        rows = request_rows(plan, want_logits, counters, model.device, self._inv_freq_on)
        check_layers = list(plan.check_layers)
        first_check, last_check = check_layers[0], max(check_layers)
        ids = rows.token_ids  # [T] on the device
        positions = torch.arange(num_tokens, device=model.device)
        by_query = self._query_mode(plan, rows, counters)
        seed = None  # rows kept first at the check layers (query_k_deviation: the probe's; funnel: sinks)
        candidates = None  # the funnel: the probe's wider set, ranked at its check layer
        prior = None  # rank fusion: the probe's [T] scores, fused with the deviation at the check layers
        if by_query:  # selection before layer 0: the blend reads every layer of the cache
            first_check = 0
            if plan.selection == "query_attention":
                check_layers, last_check = [], -1
                if qs.funnel(plan):  # the probe's rows cut to the budget by K deviation at one layer
                    last_check = plan.check_layers[0]
                    check_layers = [last_check]
        # {layer: future}, every layer from the first check layer up at once (CacheBlend §5)
        pending = start_fetch(self.source, rows, range(first_check, self.spec.num_layers), counters)
        active = positions  # [A] rows computed in this layer, ascending
        probed: dict[int, torch.Tensor] = {}  # layer -> buffer the query probe filled
        row_mask = None     # the final rows' attention mask (CUDA), built at the last check layer
        kv_layers: list[torch.Tensor] = []
        try:
            if by_query:
                active, probed, seed, prior = yield from self._select_by_query(plan, rows, pending, positions,
                                                                               counters)
                if qs.funnel(plan):  # the check layer ranks the probe's rows; the sinks stay
                    candidates, seed = seed, self._sink_seed(plan, rows)
            hidden, residual = model.embed(ids if active is positions else ids[active]), None  # [A, E]
            for layer_idx in range(self.spec.num_layers):
                q, k, v, residual = model.qkv(layer_idx, hidden, residual,
                                              positions if active is positions else positions[active])
                counters.recomputed_tokens_per_layer.append(int(active.numel()))
                if layer_idx < first_check:
                    attn_out = causal_attention(q, k, v, None, self.scale)
                    hidden, residual = model.finish_layer(layer_idx, attn_out, residual)
                    kv = torch.stack((k, v))  # [2, T, H, D]
                else:
                    kv = probed.pop(layer_idx, None)
                    if kv is None:
                        kv = self._cached_layer(rows, pending, layer_idx, counters)  # this layer's own buffer
                    elif kv.shape[1] != num_tokens:  # the probe also held the query vLLM computes
                        kv = kv[:, :num_tokens].contiguous()
                    new_active = active
                    if layer_idx in check_layers:
                        keep_local = self._select(plan, rows, layer_idx, active, k, v, kv, counters, seed, candidates,
                                                  prior)
                        new_active = active[keep_local]
                    if active.numel() == num_tokens:  # every row fresh: plain copies
                        kv[0].copy_(k)
                        kv[1].copy_(v)
                    else:
                        kv[0, active] = k
                        kv[1, active] = v
                    if new_active is not active:
                        q, residual = q[keep_local], residual[keep_local]
                    if row_mask is None and layer_idx >= last_check and new_active.is_cuda and new_active.numel():
                        # The rows stay fixed from here on: one block mask for every later
                        # layer (the CPU reference path needs none).
                        row_mask = ops.prepare_rows(new_active, num_tokens)
                    if row_mask is None:
                        attn_out = causal_attention(q, kv[0], kv[1], new_active, self.scale)
                    else:
                        attn_out = causal_attention(q, kv[0], kv[1], new_active, self.scale, row_mask)
                    hidden, residual = model.finish_layer(layer_idx, attn_out, residual)
                    active = new_active
                kv_layers.append(kv)
                if on_layer is not None:
                    on_layer(layer_idx, kv)
                yield layer_idx
            logits = None
            if want_logits:  # the last row is never reused (request_rows), so always computed
                logits = model.logits(hidden[-1:], residual[-1:])[0]
        finally:
            for fut in pending.values():
                fut.cancel()
        return BlendResult(kv_layers, logits, active.to(torch.int64).clone(), counters)
