"""Per-token K deviation at a check layer: ``||K_fresh[i] - K_cached[j]||^2`` over heads and dims.

CacheBlend (Yao et al., EuroSys 2025, §4.2) recomputes, above the check layer, the reused
tokens whose fresh K deviates most from the re-rotated cached K. The engine holds fresh K of
the computed rows ``[A, H, D]`` and cached K of all prompt rows ``[T, H, D]``; the kernel
reads the candidates straight through two index vectors (no gathered copies)::

    score[r] = sum_{h, d} (fresh[fresh_idx[r], h, d] - cached[cached_idx[r], h, d])^2   (float32)

The reference is :func:`blend.selection.k_deviation` on the gathered rows.
"""

from __future__ import annotations

import torch

from blend.kernels import Kernel, tl, use_triton
from blend.selection import k_deviation

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def deviation_reference(fresh_k: torch.Tensor, cached_k: torch.Tensor,
                        fresh_idx: torch.Tensor | None = None,
                        cached_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference of :func:`k_deviation_scores`."""
    _check(fresh_k, cached_k, fresh_idx, cached_idx)
    f = fresh_k if fresh_idx is None else fresh_k[fresh_idx.to(fresh_k.device)]
    c = cached_k if cached_idx is None else cached_k[cached_idx.to(cached_k.device)]
    return k_deviation(f, c)


def _deviation_kernel(fresh_ptr, cached_ptr, fresh_idx_ptr, cached_idx_ptr, out_ptr, num_rows,
                      stride_f, stride_c, ROW_ELEMS: tl.constexpr, HAS_FRESH_IDX: tl.constexpr,
                      HAS_CACHED_IDX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)                 # [BR]
    r_ok = r < num_rows
    if HAS_FRESH_IDX:
        fr = tl.load(fresh_idx_ptr + r, mask=r_ok, other=0).to(tl.int64)
    else:
        fr = r.to(tl.int64)
    if HAS_CACHED_IDX:
        cr = tl.load(cached_idx_ptr + r, mask=r_ok, other=0).to(tl.int64)
    else:
        cr = r.to(tl.int64)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for e0 in range(0, ROW_ELEMS, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)                          # [BE]
        ok = r_ok[:, None] & (e[None, :] < ROW_ELEMS)
        f = tl.load(fresh_ptr + fr[:, None] * stride_f + e[None, :], mask=ok, other=0.0).to(tl.float32)
        c = tl.load(cached_ptr + cr[:, None] * stride_c + e[None, :], mask=ok, other=0.0).to(tl.float32)
        diff = f - c
        acc += tl.sum(diff * diff, axis=1)
    tl.store(out_ptr + r, acc, mask=r_ok)


_KERNEL = Kernel(_deviation_kernel)


def _check(fresh_k, cached_k, fresh_idx, cached_idx) -> None:
    if fresh_k.dim() != 3 or cached_k.dim() != 3 or fresh_k.shape[1:] != cached_k.shape[1:]:
        raise ValueError(f"fresh and cached K must be [*, H, D] with equal H, D: "
                         f"{tuple(fresh_k.shape)} vs {tuple(cached_k.shape)}")
    rows_f = fresh_k.shape[0] if fresh_idx is None else fresh_idx.shape[0]
    rows_c = cached_k.shape[0] if cached_idx is None else cached_idx.shape[0]
    for name, idx in (("fresh_idx", fresh_idx), ("cached_idx", cached_idx)):
        if idx is not None and (idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool):
            raise TypeError(f"{name} must be a 1-D integer tensor, got {idx.dtype} {tuple(idx.shape)}")
    if rows_f != rows_c:
        raise ValueError(f"{rows_f} fresh rows vs {rows_c} cached rows")


def _in_range(idx: torch.Tensor | None, size: int, name: str) -> None:
    if idx is not None and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise ValueError(f"{name} holds rows outside 0..{size - 1} (min {int(idx.min())}, max {int(idx.max())})")


def deviation_triton(fresh_k: torch.Tensor, cached_k: torch.Tensor,
                     fresh_idx: torch.Tensor | None = None, cached_idx: torch.Tensor | None = None,
                     *, check_range: bool = True) -> torch.Tensor:
    """The Triton kernel (interpreted on CPU tensors); contract of :func:`k_deviation_scores`.

    Raises:
        ValueError: shapes, devices, dtypes, index ranges (when ``check_range``), or rows
            whose ``H * D`` elements are not contiguous.
    """
    _check(fresh_k, cached_k, fresh_idx, cached_idx)
    device = fresh_k.device
    tensors = [t for t in (cached_k, fresh_idx, cached_idx) if t is not None]
    if any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on {device}")
    if fresh_k.dtype not in _DTYPES or cached_k.dtype not in _DTYPES:
        raise ValueError(f"dtypes {fresh_k.dtype}, {cached_k.dtype} not supported")
    row_elems = fresh_k.shape[1] * fresh_k.shape[2]
    for t in (fresh_k, cached_k):
        if t.shape[0] and not (t.stride(2) == 1 and t.stride(1) == t.shape[2]):
            raise ValueError(f"each row's [H, D] must be contiguous; strides {t.stride()}")
    if check_range:
        _in_range(fresh_idx, fresh_k.shape[0], "fresh_idx")
        _in_range(cached_idx, cached_k.shape[0], "cached_idx")
    num_rows = fresh_k.shape[0] if fresh_idx is None else fresh_idx.shape[0]
    out = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return out
    block_e = min(512, 1 << (row_elems - 1).bit_length())
    block_r = max(1, 4096 // block_e)  # ~4K elements per tile: no register spills
    grid = (-(-num_rows // block_r),)
    dummy = out  # never read when the HAS_* flag is off
    _KERNEL.on(device)[grid](
        fresh_k, cached_k, fresh_idx if fresh_idx is not None else dummy,
        cached_idx if cached_idx is not None else dummy, out, num_rows,
        fresh_k.stride(0), cached_k.stride(0), ROW_ELEMS=row_elems,
        HAS_FRESH_IDX=fresh_idx is not None, HAS_CACHED_IDX=cached_idx is not None,
        BLOCK_R=block_r, BLOCK_E=block_e)
    return out


def k_deviation_scores(fresh_k: torch.Tensor, cached_k: torch.Tensor,
                       fresh_idx: torch.Tensor | None = None,
                       cached_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Squared L2 deviation of fresh from cached K per candidate row, summed over KV heads.

    Args:
        fresh_k: fresh post-RoPE K of the computed rows.
        cached_k: cached K re-rotated to the same positions (e.g. all prompt rows).
        fresh_idx: rows of ``fresh_k`` to score (None: all, in order).
        cached_idx: matching rows of ``cached_k`` (None: all, in order).

    Shapes:
        fresh_k: ``[A, H, D]``; cached_k: ``[T, H, D]``; fresh_idx, cached_idx: ``[R]`` int.
        Returns ``[R]`` float32 (``R = A`` or ``T`` without indices).

    Raises:
        ValueError/TypeError: shapes, index dtypes, or (on CUDA) indices out of range.
    """
    if use_triton(fresh_k, cached_k):
        return deviation_triton(fresh_k.contiguous() if fresh_k.stride(-1) != 1 else fresh_k,
                                cached_k.contiguous() if cached_k.stride(-1) != 1 else cached_k,
                                None if fresh_idx is None else fresh_idx.to(fresh_k.device),
                                None if cached_idx is None else cached_idx.to(fresh_k.device))
    return deviation_reference(fresh_k, cached_k, fresh_idx, cached_idx)
