"""Block tables of a FlexAttention mask for selected query rows over keys at ``0..T-1``.

For CacheBlend's selected-row attention (:func:`blend.flex_rows.selected_row_attention`) each query
row at position ``p`` sees keys ``0..p``. Per 128-row query block ``b`` (positions
``qmin_b..qmax_b``) and 128-key block ``c`` (keys ``c*128..``; the last block padded with
keys no query reaches)::

    full[b, c]    = kmax_c <= qmin_b                 every pair visible: no mask_mod
    partial[b, c] = kmin_c <= qmax_b and not full     mask_mod decides per pair

and the tables FlexAttention's ``BlockMask.from_kv_blocks`` takes: per query block the
count of full / partial key blocks and their indices, selected ones first in ascending
order, then the others in ascending order (a stable partition).

The reference builds them with a dozen small torch ops; the kernel does it in one launch
(the engine builds a mask per layer, and at 4K-8K tokens the blend is bound by launches:
~60 per layer measured on the H200, 2026-11-29).
"""

from __future__ import annotations

import torch

from blend.kernels import Kernel, tl, use_triton

#: Position of padded keys: no query reaches it.
NEVER = 2**62


def key_bounds(num_kv: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key block min and max position ``[nkb]`` int64 for keys ``0..T-1`` (padding NEVER)."""
    nkb = -(-num_kv // block_size)
    k_min = torch.arange(nkb, device=device, dtype=torch.int64) * block_size
    k_max = torch.where(k_min + block_size <= num_kv, k_min + block_size - 1, NEVER)
    return k_min, k_max


def _partition(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num = m.sum(-1, dtype=torch.int32)                                        # [nqb]
    idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


def block_tables_reference(q_pos_padded: torch.Tensor, num_kv: int, block_size: int):
    """``(kv_num [nqb], kv_idx [nqb, nkb], full_num, full_idx)`` int32, plain torch.

    Shapes:
        q_pos_padded: ``[nqb * block_size]`` int64 (padded rows repeat a real position, or
            sit before every key: ``blend.flex_rows.PAD_TILE_POSITION``).
    """
    nqb = q_pos_padded.numel() // block_size
    qb = q_pos_padded.view(nqb, block_size)
    q_min, q_max = qb.amin(1), qb.amax(1)
    k_min, k_max = key_bounds(num_kv, block_size, q_pos_padded.device)
    full = k_max[None, :] <= q_min[:, None]
    partial = (k_min[None, :] <= q_max[:, None]) & ~full
    return (*_partition(partial), *_partition(full))


def _block_tables_kernel(q_ptr, kv_num_ptr, kv_idx_ptr, full_num_ptr, full_idx_ptr, num_kv, num_kv_blocks,
                         BLOCK: tl.constexpr, NKB: tl.constexpr):
    b = tl.program_id(0)
    q = tl.load(q_ptr + b * BLOCK + tl.arange(0, BLOCK))                     # [BLOCK] int64
    q_min = tl.min(q, axis=0)
    q_max = tl.max(q, axis=0)
    c = tl.arange(0, NKB)                                                     # [NKB]
    valid = c < num_kv_blocks
    k_min = c.to(tl.int64) * BLOCK
    k_end = k_min + BLOCK
    full = (k_end <= num_kv) & (k_end - 1 <= q_min) & valid
    partial = (k_min <= q_max) & (~full) & valid
    for which in tl.static_range(2):
        sel = full if which == 0 else partial
        sel_i = sel.to(tl.int32)
        rest_i = ((~sel) & valid).to(tl.int32)
        count = tl.sum(sel_i, axis=0)
        slot = tl.where(sel, tl.cumsum(sel_i, axis=0) - 1, count + tl.cumsum(rest_i, axis=0) - 1)
        out_idx = full_idx_ptr if which == 0 else kv_idx_ptr
        out_num = full_num_ptr if which == 0 else kv_num_ptr
        tl.store(out_idx + b * num_kv_blocks + slot, c.to(tl.int32), mask=valid)
        tl.store(out_num + b, count)


_KERNEL = Kernel(_block_tables_kernel)


def block_tables_triton(q_pos_padded: torch.Tensor, num_kv: int, block_size: int):
    """One-launch :func:`block_tables_reference` (interpreted on CPU tensors).

    Raises:
        ValueError: a length that is not a multiple of ``block_size``, a non-int64 or
            non-contiguous ``q_pos_padded``, or a block size that is not a power of two.
    """
    if q_pos_padded.dim() != 1 or q_pos_padded.numel() % block_size or q_pos_padded.numel() == 0:
        raise ValueError(f"q_pos_padded must be [nqb * {block_size}], got {tuple(q_pos_padded.shape)}")
    if q_pos_padded.dtype != torch.int64 or not q_pos_padded.is_contiguous():
        raise ValueError("q_pos_padded must be contiguous int64")
    if block_size & (block_size - 1) or num_kv <= 0:
        raise ValueError(f"block_size={block_size} must be a power of two and num_kv={num_kv} > 0")
    device = q_pos_padded.device
    nqb, nkb = q_pos_padded.numel() // block_size, -(-num_kv // block_size)
    kv_num = torch.empty(nqb, dtype=torch.int32, device=device)
    full_num = torch.empty_like(kv_num)
    kv_idx = torch.empty(nqb, nkb, dtype=torch.int32, device=device)
    full_idx = torch.empty_like(kv_idx)
    _KERNEL.on(device)[(nqb,)](q_pos_padded, kv_num, kv_idx, full_num, full_idx, num_kv, nkb,
                               BLOCK=block_size, NKB=max(2, 1 << (nkb - 1).bit_length()))
    return kv_num, kv_idx, full_num, full_idx


def block_tables(q_pos_padded: torch.Tensor, num_kv: int, block_size: int):
    """Dispatch: the kernel on CUDA with Triton, the reference otherwise (same tables)."""
    if use_triton(q_pos_padded) and q_pos_padded.dtype == torch.int64 and q_pos_padded.is_contiguous() \
            and not block_size & (block_size - 1):
        return block_tables_triton(q_pos_padded, num_kv, block_size)
    return block_tables_reference(q_pos_padded, num_kv, block_size)
