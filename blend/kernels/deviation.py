"""Per-token KV deviation at a check layer: ``||X_fresh[i] - X_cached[j]||^2`` over heads and dims, X = K or V.

CacheBlend (Yao et al., EuroSys 2025, §4.2) recomputes, above the check layer, the reused
tokens whose fresh K deviates most from the re-rotated cached K; the engine can also rank by
V deviation or by the sum of both (``BlendEngine(score=...)``), with this same function. The
engine holds fresh K/V of the computed rows ``[A, H, D]`` and cached K/V of all prompt rows
``[T, H, D]``; the kernel reads the candidates straight through two index vectors (no
gathered copies)::

    score[r] = sum_{h, d} (fresh[fresh_idx[r], h, d] - cached[cached_idx[r], h, d])^2   (float32)

The reference is :func:`blend.selection.squared_deviation` on the gathered rows.
"""

from __future__ import annotations

import torch

from blend.kernels import Kernel, tl, use_triton
from blend.selection import squared_deviation

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def deviation_reference(fresh: torch.Tensor, cached: torch.Tensor,
                        fresh_idx: torch.Tensor | None = None,
                        cached_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference of :func:`deviation_scores`."""
    _check(fresh, cached, fresh_idx, cached_idx)
    f = fresh if fresh_idx is None else fresh[fresh_idx.to(fresh.device)]
    c = cached if cached_idx is None else cached[cached_idx.to(cached.device)]
    return squared_deviation(f, c)


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


def _check(fresh, cached, fresh_idx, cached_idx) -> None:
    if fresh.dim() != 3 or cached.dim() != 3 or fresh.shape[1:] != cached.shape[1:]:
        raise ValueError(f"fresh and cached K/V must be [*, H, D] with equal H, D: "
                         f"{tuple(fresh.shape)} vs {tuple(cached.shape)}")
    rows_f = fresh.shape[0] if fresh_idx is None else fresh_idx.shape[0]
    rows_c = cached.shape[0] if cached_idx is None else cached_idx.shape[0]
    for name, idx in (("fresh_idx", fresh_idx), ("cached_idx", cached_idx)):
        if idx is not None and (idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool):
            raise TypeError(f"{name} must be a 1-D integer tensor, got {idx.dtype} {tuple(idx.shape)}")
    if rows_f != rows_c:
        raise ValueError(f"{rows_f} fresh rows vs {rows_c} cached rows")


def _in_range(idx: torch.Tensor | None, size: int, name: str) -> None:
    if idx is not None and idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= size):
        raise ValueError(f"{name} holds rows outside 0..{size - 1} (min {int(idx.min())}, max {int(idx.max())})")


def deviation_triton(fresh: torch.Tensor, cached: torch.Tensor,
                     fresh_idx: torch.Tensor | None = None, cached_idx: torch.Tensor | None = None,
                     *, check_range: bool = True) -> torch.Tensor:
    """The Triton kernel (interpreted on CPU tensors); contract of :func:`deviation_scores`.

    Raises:
        ValueError: shapes, devices, dtypes, index ranges (when ``check_range``), or rows
            whose ``H * D`` elements are not contiguous.
    """
    _check(fresh, cached, fresh_idx, cached_idx)
    device = fresh.device
    tensors = [t for t in (cached, fresh_idx, cached_idx) if t is not None]
    if any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on {device}")
    if fresh.dtype not in _DTYPES or cached.dtype not in _DTYPES:
        raise ValueError(f"dtypes {fresh.dtype}, {cached.dtype} not supported")
    row_elems = fresh.shape[1] * fresh.shape[2]
    for t in (fresh, cached):
        if t.shape[0] and not (t.stride(2) == 1 and t.stride(1) == t.shape[2]):
            raise ValueError(f"each row's [H, D] must be contiguous; strides {t.stride()}")
    if check_range:
        _in_range(fresh_idx, fresh.shape[0], "fresh_idx")
        _in_range(cached_idx, cached.shape[0], "cached_idx")
    num_rows = fresh.shape[0] if fresh_idx is None else fresh_idx.shape[0]
    out = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return out
    block_e = min(512, 1 << (row_elems - 1).bit_length())
    block_r = max(1, 4096 // block_e)  # ~4K elements per tile: no register spills
    grid = (-(-num_rows // block_r),)
    dummy = out  # never read when the HAS_* flag is off
    _KERNEL.on(device)[grid](
        fresh, cached, fresh_idx if fresh_idx is not None else dummy,
        cached_idx if cached_idx is not None else dummy, out, num_rows,
        fresh.stride(0), cached.stride(0), ROW_ELEMS=row_elems,
        HAS_FRESH_IDX=fresh_idx is not None, HAS_CACHED_IDX=cached_idx is not None,
        BLOCK_R=block_r, BLOCK_E=block_e)
    return out


def deviation_scores(fresh: torch.Tensor, cached: torch.Tensor,
                     fresh_idx: torch.Tensor | None = None,
                     cached_idx: torch.Tensor | None = None, *, check_range: bool = True) -> torch.Tensor:
    """Squared L2 deviation of fresh from cached K (or V) per candidate row, summed over KV heads.

    Args:
        fresh: fresh K (post-RoPE) or V of the computed rows.
        cached: cached K re-rotated to the same positions, or cached V (e.g. all prompt rows).
        fresh_idx: rows of ``fresh`` to score (None: all, in order).
        cached_idx: matching rows of ``cached`` (None: all, in order).
        check_range: check the indices' bounds on CUDA (two host waits per index); False
            where the caller built them in range (the blend engine's rows).

    Shapes:
        fresh: ``[A, H, D]``; cached: ``[T, H, D]``; fresh_idx, cached_idx: ``[R]`` int.
        Returns ``[R]`` float32 (``R = A`` or ``T`` without indices).

    Raises:
        ValueError/TypeError: shapes, index dtypes, or (on CUDA) indices out of range.
    """
    if use_triton(fresh, cached):
        return deviation_triton(fresh.contiguous() if fresh.stride(-1) != 1 else fresh,
                                cached.contiguous() if cached.stride(-1) != 1 else cached,
                                None if fresh_idx is None else fresh_idx.to(fresh.device),
                                None if cached_idx is None else cached_idx.to(fresh.device),
                                check_range=check_range)
    return deviation_reference(fresh, cached, fresh_idx, cached_idx)
