"""A blend request's rows: which are hit, reused or forced, and each layer's cached-KV buffer.

:func:`request_rows` turns a :class:`~blend.plan.BlendPlan` into device index tensors once
per request (the engine's step 1); :func:`start_fetch` asks the source for the hit chunks'
layers once and :func:`layer_result` takes one of them, bounded by the load timeout;
:func:`check_layer_batch` and :func:`place_cached` validate
one layer of the hit chunks as a source delivered it and put it, K re-rotated to the prompt
positions, into the rows of that layer's ``[2, T, H, D]`` buffer (the engine's step 3).

Axis letters as in :mod:`blend.engine`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from blend import ops
from blend.plan import CHUNK, BlendPlan, Segment
from blend.protocols import KVSource, ModelSpec
from blend.result import BlendCounters
from tiers.keys import ChunkKey

#: the engine's log: a fetch that fails is one of its warnings
log = logging.getLogger("blend.engine")


@dataclass(frozen=True)
class RequestRows:
    """One request's row bookkeeping (:func:`request_rows`), on the model's device.

    Attributes:
        hits: the hit chunk segments inside ``[0, blend_end)``; keys: their chunk keys.
        hit_rows: ``[Rh]`` int64 prompt rows covered by hit chunks, ascending.
        stored_pos: ``[Rh]`` int64 positions their cached K was rotated at.
        is_reused: ``[T]`` bool rows whose KV may stay cached (hit rows minus the logits row).
        num_reused: ``is_reused.sum()``, the count the recompute ratio applies to.
        forced: ``[T]`` bool rows named by ``plan.forced_recompute`` (None: select by score).
        inv_freq: ``[D/2]`` float32 RoPE frequencies for re-rotation (None without hits).
        token_ids: ``[T]`` int64 the prompt's ids up to ``blend_end``.
        reused_rows: ``[R]`` int64 the rows of ``is_reused``, ascending.
        fresh_rows: ``[T - R]`` int64 the other rows (always computed), ascending.
        is_reused_host: ``is_reused`` on the CPU (index sets derived from it stay host-side).

    Every tensor derived from the plan is built on the host and reaches the device in one
    copy (:func:`to_device`): the blend never waits for the device to learn a row count.
    """

    hits: list[Segment]
    keys: list[ChunkKey]
    hit_rows: torch.Tensor
    stored_pos: torch.Tensor
    is_reused: torch.Tensor
    num_reused: int
    forced: torch.Tensor | None
    inv_freq: torch.Tensor | None
    token_ids: torch.Tensor
    reused_rows: torch.Tensor
    fresh_rows: torch.Tensor
    is_reused_host: torch.Tensor


def to_device(host: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Integer and bool CPU tensors onto ``device`` in one copy: on CUDA they are packed into
    one pinned int64 buffer and copied ``non_blocking`` (a copy from pageable memory, or one
    copy per tensor, makes the host wait; issue 33's profile counted 3-5 per request), then
    split into views and cast back. Elsewhere each is moved as is."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in host.items()}
    flat = [v.reshape(-1).to(torch.int64) for v in host.values()]
    total = sum(f.numel() for f in flat)
    buf = torch.empty(max(1, total), dtype=torch.int64, pin_memory=True)
    if flat:
        torch.cat(flat, out=buf[:total])
    on_device = buf.to(device, non_blocking=True)
    out, start = {}, 0
    for (k, v), f in zip(host.items(), flat, strict=True):
        part = on_device[start:start + f.numel()].view(v.shape)
        out[k] = part if v.dtype == torch.int64 else part.to(v.dtype)
        start += f.numel()
    return out



def request_rows(plan: BlendPlan, want_logits: bool, counters: BlendCounters, device: torch.device,
                 inv_freq: Callable[[torch.device], torch.Tensor]) -> RequestRows:
    """Which rows of ``[0, plan.blend_end)`` are hit, reused and forced, built once on the host
    and moved to ``device`` in one copy; fills the counters' hit/reused/computed numbers.
    ``inv_freq(device)`` gives the RoPE frequencies (asked only when there are hits).

    Raises:
        RuntimeError: the plan's stored positions do not cover its hit rows.
    """
    num_tokens = plan.blend_end
    hits = [s for s in plan.hit_segments if s.end <= num_tokens]
    hit_rows = torch.cat([torch.arange(s.start, s.end) for s in hits]) if hits \
        else torch.zeros(0, dtype=torch.int64)
    stored_pos = torch.tensor([p for s in hits for p in s.stored_positions], dtype=torch.int64)
    if stored_pos.shape != hit_rows.shape:
        raise RuntimeError(f"plan carries {stored_pos.numel()} stored positions for {hit_rows.numel()} hit rows")
    is_reused = torch.zeros(num_tokens, dtype=torch.bool)
    is_reused[hit_rows] = True
    if want_logits:
        is_reused[num_tokens - 1] = False  # the last row's logits need its hidden state
    num_reused = int(is_reused.sum())
    counters.num_hit_segments = len(hits)
    counters.reused_tokens = num_reused
    counters.computed_tokens = num_tokens - num_reused
    host = {"hit_rows": hit_rows, "stored_pos": stored_pos, "is_reused": is_reused,
            "token_ids": torch.tensor(plan.token_ids[:num_tokens], dtype=torch.int64),
            "reused_rows": torch.nonzero(is_reused).flatten(), "fresh_rows": torch.nonzero(~is_reused).flatten()}
    if plan.forced_recompute is not None:
        forced = torch.zeros(num_tokens, dtype=torch.bool)
        forced[torch.tensor([i for i in plan.forced_recompute if 0 <= i < num_tokens], dtype=torch.int64)] = True
        host["forced"] = forced
    dev = to_device(host, device)
    return RequestRows(hits, [s.key for s in hits], dev["hit_rows"], dev["stored_pos"], dev["is_reused"],
                       num_reused, dev.get("forced"), inv_freq(device) if hits else None,
                       dev["token_ids"], dev["reused_rows"], dev["fresh_rows"], is_reused)


def fit_to_source(plan: BlendPlan, source, per_token: int, counters: BlendCounters) -> BlendPlan:
    """``plan`` with the hit chunks ``source`` cannot hold at once computed instead
    (``source.fit_request``, where the source has one: a request's objects in a cache agent's
    arena): a miss known before loading, never a mid-request fallback. ``per_token``: bytes of
    a token's KV in every layer. Fills ``counters.unfit_segments`` and ``unfit_keys``; with no
    hit left the plan is full prefill. Called by the engine before a blend starts."""
    fit = getattr(source, "fit_request", None)
    hits = [(i, s) for i, s in enumerate(plan.segments) if s.kind == CHUNK and s.hit and s.end <= plan.blend_end]
    if fit is None or not hits:
        return plan
    fits = fit([s.key for _, s in hits], [s.num_tokens * per_token for _, s in hits])
    unfit = [i for (i, _), ok in zip(hits, fits, strict=True) if not ok]
    if not unfit:
        return plan
    counters.unfit_segments = len(unfit)
    counters.unfit_keys = tuple(plan.segments[i].key for i in unfit)
    log.info("the source holds %d of %d hit chunks at once; the rest are computed",
             len(hits) - len(unfit), len(hits))
    plan = plan.recomputing(unfit)
    if not plan.hit_segments:
        plan = dataclasses.replace(plan, full_prefill_reason="the source holds no hit chunk at once")
    return plan


def recompute_lost(plan: BlendPlan, lost_keys: tuple) -> BlendPlan | None:
    """``plan`` with the hit chunks named in ``lost_keys`` (found at lookup, unreadable at their
    first read) computed instead of loaded; None when none is named or no hit would be left
    (then the request is full prefill)."""
    idx = [i for i, s in enumerate(plan.segments) if s.hit and s.key in lost_keys]
    if not idx:
        return None
    again = plan.recomputing(idx)
    if not any(s.start < plan.blend_end for s in again.hit_segments):  # no hit left to blend
        return None
    return again


def check_layer_batch(rows: RequestRows, got, spec: ModelSpec, layer_idx: int) -> str | None:
    """Why layer ``layer_idx`` of the hit chunks, as a source delivered it (``got``: one
    ``[2, n_i, H, D]`` tensor per hit, or None), cannot be used; None when it can."""
    if got is None or len(got) != len(rows.hits):
        return f"layer {layer_idx} of the cached chunks could not be read"
    for seg, chunk_kv in zip(rows.hits, got, strict=True):
        want = (2, seg.num_tokens, spec.num_kv_heads, spec.head_dim)
        if chunk_kv is None or tuple(chunk_kv.shape) != want:
            return (f"layer {layer_idx} of chunk {seg.key} could not be read ("
                    f"{'missing' if chunk_kv is None else f'shape {tuple(chunk_kv.shape)} != {want}'})")
    return None


def unreadable_hits(rows: RequestRows, got, spec: ModelSpec) -> tuple:
    """Keys of the hit chunks whose layer in ``got`` (as :func:`check_layer_batch` takes it) is
    missing or malformed; ``()`` when the whole layer failed (no chunk to blame) or none did."""
    if got is None or len(got) != len(rows.hits):
        return ()
    return tuple(seg.key for seg, chunk_kv in zip(rows.hits, got, strict=True)
                 if chunk_kv is None or tuple(chunk_kv.shape) != (2, seg.num_tokens, spec.num_kv_heads, spec.head_dim))


def place_cached(kv: torch.Tensor, rows: RequestRows, got) -> None:
    """Put a checked layer (:func:`check_layer_batch`) into the hit rows of ``kv``
    ``[2, T, H, D]``: V as stored, K re-rotated from the stored to the prompt positions.

    On CUDA the compute stream first waits on the layer's ``ready`` event (a
    :class:`~tiers.codec.LayerBatch` from a staging source): the device waits, not the host.
    One cat and one scatter rather than a copy per chunk: per-layer host overhead is what
    bounds the engine below 16K tokens (issue 9). Dispatch alone (tiny tensors, one CPU
    thread, 2026-11-29): 8 (64) chunk copies 84 (514) us, cat + index_put 19 (45) us; the
    price is one more pass over the hit rows (~7 us at 4K tokens of the 7B shape).
    """
    ready = getattr(got, "ready", None)
    if ready is not None:
        torch.cuda.current_stream(kv.device).wait_event(ready)
    stored = torch.cat(got, dim=1).to(device=kv.device, dtype=kv.dtype)  # [2, Rh, H, D]
    ops.rerotate_k_(stored[0], rows.stored_pos, rows.hit_rows, rows.inv_freq)  # in place
    kv[:, rows.hit_rows] = stored


def start_fetch(source: KVSource, rows: RequestRows, layers: Iterable[int],
                counters: BlendCounters) -> dict[int, Future]:
    """Ask ``source`` once for ``layers`` of the request's hit chunks (it moves them while the
    engine computes; CacheBlend §5): ``{layer: future}``, empty without hits. A source that
    raises here sends the request to full prefill (its layers count as unreadable). When the
    last layer arrives its seconds since the ask go to ``counters.transfer_s`` (the cost
    estimates' sample), and the source's own busy seconds, where its last layer carries them,
    to ``counters.transfer_busy_s``."""
    if not rows.keys:
        return {}
    layers = list(layers)
    t0 = time.perf_counter()
    try:
        futs = source.fetch_layers(rows.keys, layers)
    except Exception as e:  # a broken source is a miss, never a failed request
        log.warning("fetch of the cached layers failed (%s: %s)", type(e).__name__, e)
        return {}
    if futs:
        futs[-1].add_done_callback(lambda f: _note_transfer(f, counters, time.perf_counter() - t0))
    return dict(zip(layers, futs, strict=False))


def _note_transfer(fut: Future, counters: BlendCounters, seconds: float) -> None:
    """Done callback of a request's last layer: its transfer sample into ``counters``."""
    if fut.cancelled() or fut.exception() is not None:
        return
    counters.transfer_s = seconds
    busy = getattr(fut.result(), "busy_s", None)
    counters.transfer_busy_s = float(busy) if isinstance(busy, (int, float)) and busy >= 0 else None


def layer_result(fut: Future | None, layer_idx: int, timeout_s: float) -> list[torch.Tensor | None] | None:
    """The layer a source's future holds, or None on any fault or after ``timeout_s`` (the
    engine's ``load_timeout_s``; then the future is cancelled: the source stops on it). Never raises."""
    if fut is None:
        return None
    try:
        return fut.result(timeout=timeout_s)
    except Exception as e:  # a broken source is a miss, never a failed request
        fut.cancel()
        why = (f"not delivered within load_timeout_s={timeout_s:g} s" if isinstance(e, TimeoutError)
               else f"{type(e).__name__}: {e}")
        log.warning("fetch of layer %d failed (%s)", layer_idx, why)
        return None
