"""Gather chunk KV out of vLLM's paged KV cache by ``slot_mapping``, and scatter it back.

A token's place in the paged cache is its slot: ``slot = block_id * block_size + offset``.
Axis letters: ``B`` blocks (``num_blocks``), ``S`` slots per block (``block_size``), ``T``
tokens (``num_tokens``, one slot each), ``H`` KV heads, ``D`` head dim. Two GPU layouts are
taken::

    flash_attn   [2, B, S, H, D]    K = cache[0],    V = cache[1]
    flashinfer   [B, 2, S, H, D]    K = cache[:, 0], V = cache[:, 1]

In both, one token's ``[H, D]`` is contiguous and the K and V views are ``[B, S, H, D]``
with strides ``(stride_block, H*D, D, 1)``; the kernel copies ``H*D`` elements per token and
side, so one launch moves a whole request's KV::

    gather:  out[0, t] = K[slot[t] // S, slot[t] % S];  out[1, t] = V[...]      out: [2, T, H, D]
    scatter: K[slot[t] // S, slot[t] % S] = kv[0, t];   V[...] = kv[1, t]

(``cluster.vllm.paged`` holds the same arithmetic for vLLM's other layouts; imports go
``cluster -> blend``, so the references here are self-contained.)
"""

from __future__ import annotations

import torch

from blend.kernels import Kernel, tl, use_triton

LAYOUTS = ("flash_attn", "flashinfer")


def kv_views(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views ``[B, S, H, D]`` of one layer's paged cache (no copies).

    Raises:
        ValueError: unknown layout or a cache of the wrong rank.
    """
    if layout == "flash_attn":
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(f"layout 'flash_attn' needs a [2, B, S, H, D] cache, got {tuple(cache.shape)}")
        return cache[0], cache[1]
    if layout == "flashinfer":
        if cache.dim() != 5 or cache.shape[1] != 2:
            raise ValueError(f"layout 'flashinfer' needs a [B, 2, S, H, D] cache, got {tuple(cache.shape)}")
        return cache[:, 0], cache[:, 1]
    raise ValueError(f"unknown paged KV layout {layout!r}; supported: {', '.join(LAYOUTS)}")


def _slots(k_view: torch.Tensor, slot_mapping: torch.Tensor, check_range: bool) -> torch.Tensor:
    if slot_mapping.dim() != 1 or slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
        raise TypeError(f"slot_mapping must be a 1-D integer tensor, got {slot_mapping.dtype} "
                        f"{tuple(slot_mapping.shape)}")
    slots = slot_mapping.to(device=k_view.device, dtype=torch.int64)
    num_slots = k_view.shape[0] * k_view.shape[1]
    if check_range and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())  # one sync; skip with check_range=False
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slot_mapping holds slots outside 0..{num_slots - 1} (min {lo}, max {hi})")
    return slots


def _check_kv(kv: torch.Tensor, k_view: torch.Tensor, num_slots: int) -> None:
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[2:] != k_view.shape[2:]:
        raise ValueError(f"kv must be [2, T, {k_view.shape[2]}, {k_view.shape[3]}], got {tuple(kv.shape)}")
    if kv.shape[1] != num_slots:
        raise ValueError(f"{kv.shape[1]} tokens of KV but {num_slots} slots")


def gather_reference(cache: torch.Tensor, layout: str, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Plain-torch gather: ``[2, T, H, D]`` in the cache's dtype (a copy)."""
    k_view, v_view = kv_views(cache, layout)
    slots = _slots(k_view, slot_mapping, True)
    block_size = k_view.shape[1]
    block, offset = slots // block_size, slots % block_size
    return torch.stack((k_view[block, offset], v_view[block, offset]))


def scatter_reference(cache: torch.Tensor, layout: str, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain-torch scatter of ``kv`` ``[2, T, H, D]`` into the slots (in place)."""
    k_view, v_view = kv_views(cache, layout)
    _check_kv(kv, k_view, slot_mapping.numel())
    slots = _slots(k_view, slot_mapping, True)
    block_size = k_view.shape[1]
    block, offset = slots // block_size, slots % block_size
    kv = kv.to(device=cache.device, dtype=cache.dtype)
    k_view[block, offset] = kv[0]
    v_view[block, offset] = kv[1]


def _paged_copy_kernel(k_cache_ptr, v_cache_ptr, kv_ptr, slot_ptr, num_tokens, block_size,
                       stride_block, stride_slot, stride_side, TOKEN_ELEMS: tl.constexpr,
                       SCATTER: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    base = (slot // block_size) * stride_block + (slot % block_size) * stride_slot
    row = t.to(tl.int64) * TOKEN_ELEMS
    for e0 in range(0, TOKEN_ELEMS, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        ok = e < TOKEN_ELEMS
        if SCATTER:
            k = tl.load(kv_ptr + row + e, mask=ok)
            v = tl.load(kv_ptr + stride_side + row + e, mask=ok)
            tl.store(k_cache_ptr + base + e, k, mask=ok)
            tl.store(v_cache_ptr + base + e, v, mask=ok)
        else:
            k = tl.load(k_cache_ptr + base + e, mask=ok)
            v = tl.load(v_cache_ptr + base + e, mask=ok)
            tl.store(kv_ptr + row + e, k, mask=ok)
            tl.store(kv_ptr + stride_side + row + e, v, mask=ok)


_KERNEL = Kernel(_paged_copy_kernel)


def _launch(cache: torch.Tensor, layout: str, kv: torch.Tensor, slots: torch.Tensor, scatter: bool) -> None:
    k_view, v_view = kv_views(cache, layout)
    num_heads, head_dim = k_view.shape[2], k_view.shape[3]
    token_elems = num_heads * head_dim
    if k_view.stride(3) != 1 or k_view.stride(2) != head_dim or k_view.stride(1) != token_elems \
            or k_view.stride() != v_view.stride():
        raise ValueError(f"paged cache {tuple(cache.shape)} with strides {cache.stride()} is not a "
                         f"contiguous {layout} layout")
    if not kv.is_contiguous() or kv.dtype != cache.dtype or kv.device != cache.device:
        raise ValueError("kv must be contiguous, in the cache's dtype and on its device")
    num_tokens = slots.numel()
    if num_tokens == 0:
        return
    block_e = min(2048, 1 << (token_elems - 1).bit_length())
    _KERNEL.on(cache.device)[(num_tokens,)](
        k_view, v_view, kv, slots, num_tokens, k_view.shape[1], k_view.stride(0), k_view.stride(1),
        kv.stride(0), TOKEN_ELEMS=token_elems, SCATTER=scatter, BLOCK_E=block_e)


def gather_triton(cache: torch.Tensor, layout: str, slot_mapping: torch.Tensor, *,
                  check_range: bool = True) -> torch.Tensor:
    """Triton gather (interpreted on CPU tensors); contract of :func:`gather_paged`."""
    k_view, _ = kv_views(cache, layout)
    slots = _slots(k_view, slot_mapping, check_range)
    out = torch.empty((2, slots.numel(), *k_view.shape[2:]), dtype=cache.dtype, device=cache.device)
    _launch(cache, layout, out, slots, scatter=False)
    return out


def scatter_triton(cache: torch.Tensor, layout: str, kv: torch.Tensor, slot_mapping: torch.Tensor, *,
                   check_range: bool = True) -> None:
    """Triton scatter (interpreted on CPU tensors); contract of :func:`scatter_paged`."""
    k_view, _ = kv_views(cache, layout)
    _check_kv(kv, k_view, slot_mapping.numel())
    slots = _slots(k_view, slot_mapping, check_range)
    _launch(cache, layout, kv.to(device=cache.device, dtype=cache.dtype).contiguous(), slots, scatter=True)


def _fast(cache: torch.Tensor) -> bool:
    if not use_triton(cache):
        return False
    return cache.stride(-1) == 1 and cache.is_contiguous()


def gather_paged(cache: torch.Tensor, layout: str, slot_mapping: torch.Tensor, *,
                 check_range: bool = True) -> torch.Tensor:
    """Read the KV at ``slot_mapping`` out of one layer's paged cache (a copy).

    Args:
        cache: one layer's paged KV cache in ``layout``.
        layout: ``flash_attn`` or ``flashinfer`` (module docstring).
        slot_mapping: one slot per token.
        check_range: validate slots (one device sync); callers that built the slots
            themselves may skip it.

    Shapes:
        cache: ``[2, B, S, H, D]`` or ``[B, 2, S, H, D]``; slot_mapping: ``[T]`` int.
        Returns ``[2, T, H, D]`` in the cache's dtype, on its device.

    Raises:
        ValueError: unknown layout, shapes, or slots outside ``0..B*S-1``.
        TypeError: a non-integer slot_mapping.
    """
    if _fast(cache):
        return gather_triton(cache, layout, slot_mapping, check_range=check_range)
    return gather_reference(cache, layout, slot_mapping)


def scatter_paged(cache: torch.Tensor, layout: str, kv: torch.Tensor, slot_mapping: torch.Tensor, *,
                  check_range: bool = True) -> None:
    """Write ``kv`` into the slots of one layer's paged cache (in place).

    Shapes:
        kv: ``[2, T, H, D]`` (cast to the cache's dtype and device); slot_mapping: ``[T]``.

    Raises:
        ValueError/TypeError: as :func:`gather_paged`, or ``kv`` of the wrong shape.
    """
    if _fast(cache):
        scatter_triton(cache, layout, kv, slot_mapping, check_range=check_range)
    else:
        scatter_reference(cache, layout, kv, slot_mapping)
