"""In-place RoPE re-rotation of cached K from stored to new positions (K only).

CacheBlend (Yao et al., EuroSys 2025, §4.3) moves a chunk's cached K from the positions it
was computed at to its positions in the new prompt by one more rotation (neox layout: pair
``i`` with ``i + D/2``, as :mod:`blend.rope` explains)::

    k[t, h, :D/2], k[t, h, D/2:] = x1, x2
    x1' = x1 cos(a) - x2 sin(a);   x2' = x2 cos(a) + x1 sin(a);   a = (to[t] - from[t]) * inv_freq

The angle table ``cos(a), sin(a)`` ``[T, D/2]`` float32 is built in torch from the integer
position difference in float64 (as :func:`blend.rope.rerotate_k` does); the kernel reads K
once and writes it once, rotating in float32 with one rounding to K's dtype.
"""

from __future__ import annotations

import torch

from blend.kernels import Kernel, tl, use_triton
from blend.rope import rerotate_k

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fingerprint(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype, t.device)


#: One cached angle table: the engine re-rotates the same rows with the same position
#: tensors in every layer. The key tensors are held (so their memory cannot be reused while
#: cached) and fingerprinted with their version counters (so in-place edits miss).
_ANGLE_CACHE: list[tuple[tuple, tuple, torch.Tensor, torch.Tensor]] = []


def angle_table(from_positions: torch.Tensor, to_positions: torch.Tensor,
                inv_freq: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of ``(to - from) * inv_freq``: two ``[T, D/2]`` float32 tensors on ``device``.

    The integer difference is formed in int64 and multiplied in float64, so an angle of
    32K positions keeps ~1e-12 rad of precision before the float32 rounding. The last table
    is reused while the same (unmodified) position tensors on ``device`` come back."""
    cacheable = from_positions.device == device and to_positions.device == device
    if cacheable:
        key = (_fingerprint(from_positions), _fingerprint(to_positions), _fingerprint(inv_freq), device)
        entry = _ANGLE_CACHE[0] if _ANGLE_CACHE else None
        if entry is not None and entry[0] == key:
            return entry[2], entry[3]
    cos, sin = _angle_table(from_positions, to_positions, inv_freq, device)
    if cacheable:
        _ANGLE_CACHE[:] = [(key, (from_positions, to_positions, inv_freq), cos, sin)]
    return cos, sin


def _angle_table(from_positions, to_positions, inv_freq, device):
    delta = (to_positions.to(device, torch.int64) - from_positions.to(device, torch.int64))
    angle = delta.to(torch.float64)[:, None] * inv_freq.to(device, torch.float64)[None, :]  # [T, D/2]
    return angle.cos().to(torch.float32).contiguous(), angle.sin().to(torch.float32).contiguous()


def rerotate_reference_(k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor,
                        inv_freq: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference: :func:`blend.rope.rerotate_k` written back into ``k``."""
    k.copy_(rerotate_k(k, from_positions, to_positions, inv_freq))
    return k


def _rerotate_kernel(k_ptr, cos_ptr, sin_ptr, num_tokens, stride_t, stride_h,
                     NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)                    # [BT]
    h = tl.arange(0, BLOCK_H)                                     # [BH]
    d = tl.arange(0, HALF)                                        # [D/2]
    t_ok = t < num_tokens
    cs = t[:, None] * HALF + d[None, :]                           # [BT, D/2]
    cos = tl.load(cos_ptr + cs, mask=t_ok[:, None], other=0.0)[:, None, :]
    sin = tl.load(sin_ptr + cs, mask=t_ok[:, None], other=0.0)[:, None, :]
    off = (t[:, None, None].to(tl.int64) * stride_t + h[None, :, None] * stride_h
           + d[None, None, :])                                    # [BT, BH, D/2]
    ok = t_ok[:, None, None] & (h[None, :, None] < NUM_HEADS) & (d[None, None, :] < HALF)
    x1 = tl.load(k_ptr + off, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + off + HALF, mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    tl.store(k_ptr + off, y1.to(k_ptr.dtype.element_ty), mask=ok)
    tl.store(k_ptr + off + HALF, y2.to(k_ptr.dtype.element_ty), mask=ok)


_KERNEL = Kernel(_rerotate_kernel)


def _check(k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor,
           inv_freq: torch.Tensor) -> None:
    if k.dim() != 3 or k.shape[-1] != 2 * inv_freq.shape[-1] or inv_freq.dim() != 1:
        raise ValueError(f"k must be [T, H, D] with D = 2 * len(inv_freq) = {2 * inv_freq.shape[-1]}, "
                         f"got {tuple(k.shape)}")
    if from_positions.shape != (k.shape[0],) or to_positions.shape != (k.shape[0],):
        raise ValueError(f"positions must be [{k.shape[0]}], got {tuple(from_positions.shape)} "
                         f"and {tuple(to_positions.shape)}")
    if from_positions.dtype.is_floating_point or to_positions.dtype.is_floating_point:
        raise TypeError(f"positions must be integers, got {from_positions.dtype}, {to_positions.dtype}")


def rerotate_triton_(k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor,
                     inv_freq: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (interpreted on CPU tensors); same contract as :func:`rerotate_k_`.

    Raises:
        ValueError: shapes, a non-unit stride in D, D/2 not a power of two, or an
            unsupported dtype.
    """
    _check(k, from_positions, to_positions, inv_freq)
    half = k.shape[-1] // 2
    if k.dtype not in _DTYPES:
        raise ValueError(f"k dtype {k.dtype} not supported (one of {_DTYPES})")
    if k.stride(-1) != 1 or half & (half - 1):
        raise ValueError(f"k needs unit stride in D and D/2 a power of two; strides {k.stride()}, D={k.shape[-1]}")
    num_tokens, num_heads = k.shape[0], k.shape[1]
    if num_tokens == 0:
        return k
    cos, sin = angle_table(from_positions, to_positions, inv_freq, k.device)
    block_h = 1 << max(0, (num_heads - 1).bit_length())
    block_t = max(1, 4096 // (block_h * half))  # ~4K elements per half: 16 KiB of bf16 K per program
    grid = (triton_cdiv(num_tokens, block_t),)
    _KERNEL.on(k.device)[grid](k, cos, sin, num_tokens, k.stride(0), k.stride(1),
                               NUM_HEADS=num_heads, HALF=half, BLOCK_T=block_t, BLOCK_H=block_h)
    return k


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rerotate_k_(k: torch.Tensor, from_positions: torch.Tensor, to_positions: torch.Tensor,
                inv_freq: torch.Tensor) -> torch.Tensor:
    """Re-rotate post-RoPE K in place from ``from_positions`` to ``to_positions``.

    Args:
        k: post-RoPE keys (float16, bfloat16 or float32), modified in place.
        from_positions: positions ``k`` was rotated at.
        to_positions: target positions.
        inv_freq: inverse frequencies of a position-linear RoPE (:func:`blend.rope.inv_freq_for`).

    Shapes:
        k: ``[T, H, D]`` (unit stride in D); positions: ``[T]`` int; inv_freq: ``[D/2]``.
        Returns ``k``.

    Uses the Triton kernel for CUDA tensors, :func:`rerotate_reference_` otherwise (or for
    layouts the kernel does not take).

    Raises:
        ValueError/TypeError: shapes or dtypes that do not match.
    """
    _check(k, from_positions, to_positions, inv_freq)
    half = k.shape[-1] // 2
    if use_triton(k) and k.dtype in _DTYPES and k.stride(-1) == 1 and not half & (half - 1):
        return rerotate_triton_(k, from_positions, to_positions, inv_freq)
    return rerotate_reference_(k, from_positions, to_positions, inv_freq)
