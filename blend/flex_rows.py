"""Selected query rows' causal attention on CUDA: FlexAttention with a block mask built from the
rows' positions, compiled per padded shape.

CacheBlend recomputes only selected tokens above the check layer (Yao et al., EuroSys 2025,
§4.2): each selected row at prompt position ``p`` attends to every key at position ``<= p``.
What this module holds, for :func:`blend.ops.causal_attention` (its entry point) and the query
probe's graphs (:mod:`blend.probe_graphs`):

* :func:`selected_row_attention` — the attention itself: compiled FlexAttention on CUDA,
  :func:`selected_row_attention_reference` (SDPA over blocks of rows) elsewhere or when
  FlexAttention fails (once, logged).
* :func:`build_block_mask` / :func:`prepare_rows` — the ``BlockMask`` from per-block position
  bounds (never a dense ``[Q, T]`` mask), built once per request as a :class:`RowMask`.
* :func:`shape_bucket`, :func:`pad_rows` — rows and keys padded to a bounded set of compiled
  shapes; whole pad tiles sit at :data:`PAD_TILE_POSITION` and cost no key block.
* :func:`prepare_flex` — every key bucket compiled at start-up (:mod:`blend.flex_shapes`
  records what was compiled and how far a call's rows pad).

Axis letters as in :mod:`blend.protocols`; ``Q`` = selected query rows.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blend import flex_shapes
from blend.attention import check_heads
from blend.kernels.blockmask import NEVER, block_tables

log = logging.getLogger(__name__)

__all__ = ["FLEX_BLOCK", "PAD_TILE_POSITION", "RowMask", "build_block_mask", "pad_rows", "prepare_flex",
           "prepare_rows", "selected_row_attention", "selected_row_attention_reference", "shape_bucket"]

#: FlexAttention tile (rows and keys per block of the block mask).
FLEX_BLOCK = 128
#: Query rows per SDPA call on the reference path (bounds the ``[Qb, T]`` mask).
REFERENCE_QUERY_BLOCK = 1024
#: Position given to padded keys: never visible to any query.
_NEVER = NEVER
#: Rows :func:`prepare_flex` compiles for every key bucket besides as many rows as keys: the
#: query probe's buckets (its ~65 rows: prefix, separators, query; 129-256 with a longer system
#: prompt or query), which would otherwise pad up to the key count (256 MB of queries a layer
#: at 32K keys). The probe's CUDA graphs capture the same row buckets
#: (:data:`blend.probe_graphs.ROW_BUCKETS`).
PROBE_ROWS = (128, 256)
#: Position of a whole tile of padded query rows in :func:`selected_row_attention`: before
#: every key, so the block mask gives the tile no key block (its program loads the tile's
#: queries and writes zeros, nothing else). At position 0 each such tile read one key block:
#: an 8K blend's 1,302 rows padded to a prepared 12,288-row shape took 0.786 ms a layer against
#: 0.544 ms unpadded, 0.716 ms at -1 (H100, 2026-12-07; ``docs/flexpad-h100.json``).
PAD_TILE_POSITION = -1
#: Compiled FlexAttention shapes kept before torch.compile gives up and runs it eagerly
#: (dynamo's default is 8; every (query bucket, key bucket) pair is one shape, see
#: :func:`shape_bucket`).
FLEX_RECOMPILE_LIMIT = 256


def shape_bucket(n: int) -> int:
    """The padded length FlexAttention is compiled for: the smallest of 128, 256, 384, 512,
    768, 1024, ... (``128 * 2**k`` and ``192 * 2**k``, whole 128-row tiles) that holds ``n``:
    at most 50% padding above 256 (128 below), two shapes per doubling, so a server sees a
    bounded set of compiled shapes whatever its prompt lengths."""
    size = FLEX_BLOCK
    while size < n:
        size = 2 * size if size == FLEX_BLOCK else (size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3)
    return size


def _check_attention(q_sel, q_pos, k, v, kv_pos) -> None:
    check_heads(q_sel, k, v, "q_sel")
    if q_pos.shape != (q_sel.shape[0],):
        raise ValueError(f"q_pos must be [{q_sel.shape[0]}], got {tuple(q_pos.shape)}")
    if kv_pos is not None and kv_pos.shape != (k.shape[0],):
        raise ValueError(f"kv_pos must be [{k.shape[0]}], got {tuple(kv_pos.shape)}")
    for name, t in (("q_pos", q_pos), ("kv_pos", kv_pos)):
        if t is not None and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise TypeError(f"{name} must be integer positions, got {t.dtype}")


def selected_row_attention_reference(q_sel: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
                                     v: torch.Tensor, kv_pos: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA over blocks of :data:`REFERENCE_QUERY_BLOCK` query rows, each with its ``[Qb, T]``
    boolean mask ``kv_pos <= q_pos``. Same contract as :func:`selected_row_attention`."""
    _check_attention(q_sel, q_pos, k, v, kv_pos)
    device = k.device
    kv_pos = torch.arange(k.shape[0], device=device) if kv_pos is None else kv_pos.to(device)
    q_pos = q_pos.to(device)
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    outs = []
    for start in range(0, q_sel.shape[0], REFERENCE_QUERY_BLOCK):
        qb = q_sel[start:start + REFERENCE_QUERY_BLOCK]
        mask = kv_pos[None, :] <= q_pos[start:start + REFERENCE_QUERY_BLOCK, None]  # [Qb, T]
        out = F.scaled_dot_product_attention(qb.transpose(0, 1).unsqueeze(0), kh, vh, attn_mask=mask,
                                             scale=scale, enable_gqa=True)  # [1, Hq, Qb, D]
        outs.append(out[0].transpose(0, 1).reshape(qb.shape[0], -1))
    if not outs:
        return q_sel.new_zeros(0, q_sel.shape[1] * q_sel.shape[2])
    return torch.cat(outs)  # [Q, Hq * D]


def _pad(x: torch.Tensor, length: int, value: int | None) -> torch.Tensor:
    """Pad a 1-D tensor to ``length`` with ``value`` (None: repeat the last element)."""
    if x.numel() == length:
        return x
    fill = x[-1:].expand(length - x.numel()) if value is None else x.new_full((length - x.numel(),), value)
    return torch.cat((x, fill))


@functools.cache
def _key_positions(num_kv: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Positions ``[Tp]`` of keys ``0..T-1`` padded to whole blocks with a position no query
    reaches (what ``mask_mod`` reads), cached per ``(T, block, device)`` and never evicted:
    a captured CUDA graph (:mod:`blend.probe_graphs`) reads it by address. ``T`` takes the
    bounded set of :func:`shape_bucket` values (16 up to 32K tokens, 256 KiB at most each)."""
    nkb = -(-num_kv // block_size)
    kp = torch.arange(nkb * block_size, device=device, dtype=torch.int64)
    kp[num_kv:] = _NEVER
    return kp


def build_block_mask(q_pos: torch.Tensor, kv_pos: torch.Tensor | None, num_kv: int | None = None,
                     block_size: int = FLEX_BLOCK):
    """FlexAttention ``BlockMask`` for "query at ``q_pos[i]`` sees keys with ``kv_pos <= q_pos[i]``".

    Built from per-block minima and maxima, never from a dense mask::

        q block b covers rows [b*128, b*128+128): qmin_b, qmax_b of their positions
        kv block c covers keys [c*128, ...):      kmin_c, kmax_c
        full    (no mask needed)  kmax_c <= qmin_b
        partial (mask_mod needed) kmin_c <= qmax_b and not full
        skipped otherwise

    Sorted ``q_pos`` (the engine's ascending rows) gives the fewest partial blocks; any order
    is correct. Padded keys get a position no query reaches; padded queries repeat the last
    (whole pad tiles: see :func:`pad_rows`).

    Args:
        q_pos: position of each query row (pad rows already appended, if any).
        kv_pos: position of each key, or None for ``0..num_kv-1`` (cached block bounds).
        num_kv: number of keys when ``kv_pos`` is None.

    Shapes:
        q_pos: ``[Q]`` int64, kv_pos: ``[T]`` int64, on the same device.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = q_pos.device
    num_q = q_pos.numel()
    nqb = -(-num_q // block_size)
    qp = _pad(q_pos.to(torch.int64), nqb * block_size, None).contiguous()  # [Qp]
    if kv_pos is None:
        if num_kv is None:
            raise ValueError("num_kv is needed when kv_pos is None")
        num_kv = int(num_kv)
        kp = _key_positions(num_kv, block_size, device)                   # [Tp]
        tables = block_tables(qp, num_kv, block_size)                      # one launch on CUDA
        kv_num, kv_idx, full_num, full_idx = (t[None, None] for t in tables)
    else:
        num_kv = kv_pos.numel()
        nkb = -(-num_kv // block_size)
        kp = _pad(kv_pos.to(torch.int64), nkb * block_size, _NEVER)       # [Tp]
        kb = kp.view(nkb, block_size)
        k_min, k_max = kb.amin(1), kb.amax(1)                             # [nkb]
        qb = qp.view(nqb, block_size)
        q_min, q_max = qb.amin(1), qb.amax(1)                              # [nqb]
        full = k_max[None, :] <= q_min[:, None]                            # [nqb, nkb]
        partial = (k_min[None, :] <= q_max[:, None]) & ~full

        def blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            num = m.sum(-1, dtype=torch.int32)                             # [nqb]
            idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # True first
            return num[None, None], idx[None, None]

        kv_num, kv_idx = blocks(partial)
        full_num, full_idx = blocks(full)

    def mask_mod(b, h, q_idx, kv_idx):
        return kp[kv_idx] <= qp[q_idx]

    kwargs = dict(BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(num_q, num_kv))
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, compute_q_blocks=False, **kwargs)
    except TypeError:  # a torch without compute_q_blocks
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, **kwargs)


@functools.cache
def _compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # static shapes: torch 2.11's inductor found no kernel choice for flex_attention with
    # dynamic shapes (NoValidChoicesError, H200, 2026-11-29); each bucketed (Q, T) compiles
    # once. Past dynamo's recompile limit (8 shapes) flex_attention runs unfused, eagerly
    # (seen on the H200, 2026-12-01: bench blend over 20 prompts of varying length): the
    # limit is raised for the bounded set of bucketed shapes.
    cfg = torch._dynamo.config
    for name, floor in (("recompile_limit", FLEX_RECOMPILE_LIMIT), ("cache_size_limit", FLEX_RECOMPILE_LIMIT),
                        ("accumulated_recompile_limit", 4 * FLEX_RECOMPILE_LIMIT),
                        ("accumulated_cache_size_limit", 4 * FLEX_RECOMPILE_LIMIT)):
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) < floor:
            setattr(cfg, name, floor)
    return torch.compile(flex_attention, dynamic=False)


_FLEX_BROKEN: list[str] = []


@dataclass(frozen=True)
class RowMask:
    """The selected rows' FlexAttention mask, prepared once per request.

    Above the last check layer the engine attends with the same rows over the same number
    of keys in every layer, so the padded positions and the block mask can be built once
    (:func:`prepare_rows`) and passed to every :func:`selected_row_attention` call.

    Attributes:
        q_pos_padded: ``[Qp]`` int64, positions padded to :func:`shape_bucket` rows.
        num_q: real query rows ``Q``; num_kv: keys ``T``; kv_len: ``shape_bucket(T)``, the
            keys the mask (and the padded K/V) spans.
        block_mask: the ``BlockMask`` (keys at ``kv_pos``, or ``0..T-1``; padded keys unseen).
    """

    q_pos_padded: torch.Tensor
    num_q: int
    num_kv: int
    block_mask: object
    kv_len: int = 0


def prepare_rows(q_pos: torch.Tensor, num_kv: int, kv_pos: torch.Tensor | None = None) -> RowMask:
    """Build the :class:`RowMask` of rows at ``q_pos`` ``[Q]`` over ``num_kv`` keys (on
    ``q_pos``'s device; a CUDA mask for CUDA positions).

    Raises:
        ValueError/TypeError: empty or non-integer positions, or a ``kv_pos`` of another length.
    """
    if q_pos.dim() != 1 or q_pos.numel() == 0 or q_pos.dtype.is_floating_point or q_pos.dtype == torch.bool:
        raise TypeError(f"q_pos must be a non-empty 1-D integer tensor, got {q_pos.dtype} {tuple(q_pos.shape)}")
    if kv_pos is not None and kv_pos.shape != (num_kv,):
        raise ValueError(f"kv_pos must be [{num_kv}], got {tuple(kv_pos.shape)}")
    num_q = q_pos.numel()
    kv_len = shape_bucket(int(num_kv))
    padded = pad_rows(q_pos.to(torch.int64), flex_shapes.rows_for(num_q, kv_len, q_pos.device, shape_bucket(num_q)),
                      PAD_TILE_POSITION)
    mask = build_block_mask(padded, _pad_keys(kv_pos, kv_len, q_pos.device), kv_len)
    return RowMask(padded, num_q, int(num_kv), mask, kv_len)


def pad_rows(q_pos: torch.Tensor, length: int, tail: int = 0) -> torch.Tensor:
    """Query positions ``[Q]`` padded to ``length``: the last real 128-row tile repeats its
    last position; whole padded tiles get position ``tail``: 0 reads one key block (every row
    sees a key: the probe's padded rows, whose attention mass is computed), and
    :data:`PAD_TILE_POSITION` reads none (FlexAttention's pad tiles when only their rows'
    output is dropped)."""
    tile = -(-q_pos.numel() // FLEX_BLOCK) * FLEX_BLOCK
    return _pad(_pad(q_pos, tile, None), length, tail).contiguous()


def _padded_rows(q: torch.Tensor, length: int) -> torch.Tensor:
    """Queries ``[Q, Hq, D]`` in a ``[length, Hq, D]`` buffer: the pad rows of the last real
    128-row tile repeat the last row; whole pad tiles are left unwritten, as their position
    (:data:`PAD_TILE_POSITION`) gives them no key block: the kernel loads their queries but
    multiplies them with no key (their rows come out 0) and their output rows are dropped. Writing them (a ``cat``) cost 0.19 ms a layer for an 8K
    blend's rows padded to a prepared 12,288-row shape (H100, 2026-12-07)."""
    num_q = q.shape[0]
    tile = min(length, -(-num_q // FLEX_BLOCK) * FLEX_BLOCK)
    out = q.new_empty((length, *q.shape[1:]))
    out[:num_q].copy_(q)
    if tile > num_q:
        out[num_q:tile].copy_(q[-1:].expand(tile - num_q, *q.shape[1:]))
    return out


def _pad_keys(kv_pos: torch.Tensor | None, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Key positions padded to ``kv_len`` with a position no query reaches (None stays None:
    keys ``0..kv_len-1``, whose padded tail lies past every query's position)."""
    return None if kv_pos is None else _pad(kv_pos.to(device, torch.int64), kv_len, _NEVER)


def selected_row_attention(q_sel: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_pos: torch.Tensor | None, scale: float, *,
                           rows: RowMask | None = None) -> torch.Tensor:
    """Causal attention of selected query rows over all keys, each row with its own limit.

    CacheBlend recomputes only selected tokens above the check layer (Yao et al., §4.2); each
    selected row at prompt position ``p`` attends to every key at position ``<= p``::

        keys:   0 1 2 3 4 5 6 7      query at position 4 sees keys 0..4
        q(4) -> x x x x x . . .

    Args:
        q_sel: queries (after RoPE) of the selected rows.
        q_pos: prompt position of each selected row (any order; ascending is fastest).
        k, v: keys (after RoPE) and values of the prompt (fresh rows written over cached).
        kv_pos: position of each key (None: ``0..T-1``).
        scale: softmax scale.
        rows: the same rows' :class:`RowMask` from :func:`prepare_rows` (built once per
            request; the CUDA path then builds nothing per call).

    Shapes:
        q_sel: ``[Q, Hq, D]``; q_pos: ``[Q]`` int; k, v: ``[T, H, D]``; kv_pos: ``[T]`` int.
        Returns ``[Q, Hq * D]`` in ``q_sel.dtype``.

    CUDA: compiled FlexAttention with :func:`build_block_mask` (grouped-query heads native).
    Elsewhere, or if compiling fails (logged once): :func:`selected_row_attention_reference`.

    Raises:
        ValueError/TypeError: inconsistent shapes, non-integer positions, or ``rows`` made
            for another number of rows or keys.
    """
    _check_attention(q_sel, q_pos, k, v, kv_pos)
    if rows is not None and (rows.num_q != q_sel.shape[0] or rows.num_kv != k.shape[0]):
        raise ValueError(f"rows were prepared for {rows.num_q} rows over {rows.num_kv} keys, "
                         f"got {q_sel.shape[0]} over {k.shape[0]}")
    if not (q_sel.is_cuda and k.is_cuda) or _FLEX_BROKEN or q_sel.shape[0] == 0:
        return selected_row_attention_reference(q_sel, q_pos, k, v, kv_pos, scale)
    return _flex_rows(q_sel, q_pos, k, v, kv_pos, scale, rows)


def _flex_rows(q_sel, q_pos, k, v, kv_pos, scale, rows: RowMask | None = None):
    """The FlexAttention path of :func:`selected_row_attention` (any device; CUDA in use)."""
    device = k.device
    num_q, num_kv = q_sel.shape[0], k.shape[0]
    # Query rows and keys padded to shape buckets (rows: the last tile's copies of the last row,
    # whole tiles unwritten at PAD_TILE_POSITION, all dropped after;
    # keys: zeros no query sees): torch 2.11's inductor finds no flex kernel for fewer than
    # 128 rows (H200, 2026-11-29), and each (rows, keys) shape is compiled once, so buckets
    # bound the number of compiled shapes over any mix of prompt lengths; on a device that
    # prepare_flex prepared, rows pad up to a compiled shape instead (blend.flex_shapes).
    kv_len = shape_bucket(num_kv)
    num_q_pad = (rows.q_pos_padded.numel() if rows is not None
                 else flex_shapes.rows_for(num_q, kv_len, device, shape_bucket(num_q)))
    if num_q_pad != num_q:
        q_sel = _padded_rows(q_sel, num_q_pad)
    if kv_len != num_kv:
        k = F.pad(k, (0, 0, 0, 0, 0, kv_len - num_kv))
        v = F.pad(v, (0, 0, 0, 0, 0, kv_len - num_kv))
    if rows is None:
        q_pos = pad_rows(q_pos.to(device, torch.int64), num_q_pad, PAD_TILE_POSITION)
        block_mask = build_block_mask(q_pos, _pad_keys(kv_pos, kv_len, device), kv_len)
    else:
        q_pos, block_mask = rows.q_pos_padded, rows.block_mask
    qh = q_sel.transpose(0, 1).unsqueeze(0)  # [1, Hq, Qp, D]
    kh = k.transpose(0, 1).unsqueeze(0)      # [1, H, T, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    try:
        out = _compiled_flex()(qh, kh, vh, block_mask=block_mask, scale=scale, enable_gqa=True)
    except Exception as e:  # noqa: BLE001 - no compiler / unsupported shape: stay correct
        if q_sel.is_cuda and torch.cuda.is_current_stream_capturing():
            raise  # a CUDA graph's capture failed (blend.probe_graphs), not FlexAttention
        _FLEX_BROKEN.append(f"{type(e).__name__}: {e}")
        log.warning("FlexAttention unavailable (%s: %s); using the SDPA reference", type(e).__name__, e)
        return selected_row_attention_reference(q_sel[:num_q], q_pos[:num_q], k[:num_kv], v[:num_kv], kv_pos, scale)
    flex_shapes.note_compiled(device, num_q_pad, kv_len)
    return out[0, :, :num_q].transpose(0, 1).reshape(num_q, -1)  # [Q, Hq * D]


def prepare_flex(max_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, scale: float) -> dict:
    """Compile FlexAttention now for every key bucket (:func:`shape_bucket`) up to
    ``max_tokens`` keys, each with :data:`PROBE_ROWS` and with as many rows as keys, then mark
    ``device`` prepared: a later call over at most that many keys pads its rows up to a
    compiled shape rather than compile one (:mod:`blend.flex_shapes`; a new shape compiled
    inside a request took 2.4-4.7 s).

    Gradients are off here, as in every request (:func:`blend.steps.run_steps`); a caller whose
    requests run under ``torch.inference_mode`` (the vLLM worker) calls this under it too:
    compiled code is guarded by that mode and would compile again in the first request.

    Who calls it: the vLLM worker when it builds its blend engine at start-up
    (``blend.flex_warm_tokens``), and ``kvblend bench gpu`` before timing. The shapes are the
    model's: ``num_heads`` query and ``num_kv_heads`` KV heads of ``head_dim``, ``dtype``, the
    engine's softmax ``scale``. CUDA only; elsewhere, with ``max_tokens <= 0`` or once
    FlexAttention failed, nothing happens. A failed compile is logged and leaves the device
    unprepared (shapes then compile on first use, as without this).

    Returns:
        ``{"seconds": wall time, "shapes": (rows, keys) pairs compiled, "max_keys": the largest
        key bucket}``.
    """
    out = {"seconds": 0.0, "shapes": 0, "max_keys": 0}
    device = torch.device(device)
    if device.type != "cuda" or max_tokens <= 0 or _FLEX_BROKEN:
        return out
    if device.index is None:  # the key tensors' own device names it with its index
        device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    keys, top = FLEX_BLOCK, shape_bucket(max_tokens)
    try:
        with torch.no_grad():
            while not _FLEX_BROKEN:
                kv = torch.zeros(keys, num_kv_heads, head_dim, dtype=dtype, device=device)
                for rows in sorted({r for r in PROBE_ROWS if r < keys} | {keys}):
                    q = torch.zeros(rows, num_heads, head_dim, dtype=dtype, device=device)
                    pos = torch.arange(keys - rows, keys, device=device)
                    _flex_rows(q, pos, kv, kv, None, scale, prepare_rows(pos, keys))
                    out["shapes"] += 1
                if keys >= top:
                    break
                keys = shape_bucket(keys + 1)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - out of memory, no compiler: compile on first use instead
        log.warning("preparing FlexAttention's shapes failed at %d keys (%s: %s)", keys, type(e).__name__, e)
        return {**out, "seconds": time.perf_counter() - start}
    if not _FLEX_BROKEN:
        flex_shapes.mark_prepared(device, top)
        out["max_keys"] = top
    out["seconds"] = time.perf_counter() - start
    return out
