"""Move chunk KV ``[2, T, H, D]`` in and out of vLLM's paged KV caches by ``slot_mapping``.

vLLM keeps one KV tensor per attention layer, split into blocks (pages) of ``block_size``
tokens. A token's place is its **slot**: ``slot = block_id * block_size + offset``
(``slot_mapping`` holds one slot per token). Flat slots survive a kernel block size that
divides the scheduler's block size, so callers never need the kernel block size.

Axis letters: ``B`` = blocks (``num_blocks``), ``S`` = slots per block (``block_size``),
``T`` = tokens (one slot each), ``H`` = KV heads, ``D`` = head dim. Layouts supported::

    cpu         [B, H, S, 2*D]   vLLM 0.32 CPU backend, ISA 'vec' (x86 without AMX): per
                                 (block, head), K transposed [D, S], then V [S, D] (located
                                 element by element on a live engine; other CPU ISAs tile
                                 differently, so the connector writes through the backend's
                                 own ``do_kv_cache_update`` and uses this layout for reads)
    packed      [B, H, S, 2*D]   vLLM 0.32 logical per-layer view of the GPU backends
                                 (FlashAttention, FlashInfer): K = [..., :D], V = [..., D:]
    flash_attn  [2, B, S, H, D]  FlashAttention's classic layout (vLLM <= 0.11)
    flashinfer  [B, 2, S, H, D]  FlashInfer's classic NHD layout (vLLM <= 0.11)

The ``cpu`` and ``packed`` layouts have the same shape: they differ in where a token's V
lives, so the layout must be named (:func:`detect_layout` asks the platform).

Every function is plain torch (advanced indexing on strided views of the cache): the
reference for any faster kernel. Out-of-range slots raise ``ValueError`` (never a silent
write outside the request's blocks).
"""

from __future__ import annotations

import torch

from blend.kernels.paged import LAYOUTS as GPU_LAYOUTS
from blend.kernels.paged import kv_views as gpu_kv_views

LAYOUTS = ("cpu", "packed", *GPU_LAYOUTS)


def kv_views(cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided K and V views of one layer's paged cache, each ``[B, S, H, D]``.

    Writing into the views writes the cache (no copies).

    Raises:
        ValueError: unknown layout or a cache whose rank does not fit it.
    """
    if layout in ("cpu", "packed"):
        if cache.dim() != 4 or cache.shape[-1] % 2:
            raise ValueError(f"layout {layout!r} needs a [B, H, S, 2*D] cache, got {tuple(cache.shape)}")
        num_blocks, num_heads, block_size, two_d = cache.shape
        if layout == "cpu":
            if not cache.is_contiguous():
                raise ValueError("the cpu layout needs a contiguous cache")
            head_dim = two_d // 2
            kv = cache.view(num_blocks, num_heads, 2, block_size * head_dim)     # [B, H, 2, S*D]
            k_t = kv[:, :, 0].view(num_blocks, num_heads, head_dim, block_size)  # [B, H, D, S]
            v = kv[:, :, 1].view(num_blocks, num_heads, block_size, head_dim)    # [B, H, S, D]
            return k_t.permute(0, 3, 1, 2), v.permute(0, 2, 1, 3)                # [B, S, H, D]
        else:
            k, v = cache[..., : two_d // 2], cache[..., two_d // 2:]            # [B, H, S, D]
        return k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)                      # [B, S, H, D]
    if layout in GPU_LAYOUTS:
        return gpu_kv_views(cache, layout)  # the GPU layouts' views live beside their Triton kernel
    raise ValueError(f"unknown paged KV layout {layout!r}; supported: {', '.join(LAYOUTS)}")


def _block_offset(k_view: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, block_size = k_view.shape[0], k_view.shape[1]
    slots = slot_mapping.to(device=k_view.device, dtype=torch.long)
    if slots.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slots.shape)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(f"slot_mapping holds slots outside 0..{num_blocks * block_size - 1} "
                         f"(min {int(slots.min())}, max {int(slots.max())})")
    return slots // block_size, slots % block_size


def scatter_kv(cache: torch.Tensor, layout: str, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``kv`` into the slots of ``cache`` (in place).

    Shapes:
        cache: one layer, see the module docstring. kv: ``[2, T, H, D]`` (cast to the cache's
        dtype and device). slot_mapping: ``[T]`` int.

    Raises:
        ValueError: shape mismatch or slots out of range.
    """
    k_view, v_view = kv_views(cache, layout)
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[2:] != k_view.shape[2:]:
        raise ValueError(f"kv must be [2, T, {k_view.shape[2]}, {k_view.shape[3]}], got {tuple(kv.shape)}")
    if kv.shape[1] != slot_mapping.numel():
        raise ValueError(f"{kv.shape[1]} tokens of KV but {slot_mapping.numel()} slots")
    block_idx, offset = _block_offset(k_view, slot_mapping)
    kv = kv.to(device=cache.device, dtype=cache.dtype)
    k_view[block_idx, offset] = kv[0]
    v_view[block_idx, offset] = kv[1]


def gather_kv(cache: torch.Tensor, layout: str, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Read the KV at ``slot_mapping`` (a copy).

    Shapes:
        returns ``[2, T, H, D]`` in the cache's dtype, for ``slot_mapping`` ``[T]``.
    """
    k_view, v_view = kv_views(cache, layout)
    block_idx, offset = _block_offset(k_view, slot_mapping)
    return torch.stack((k_view[block_idx, offset], v_view[block_idx, offset]))


def slot_mapping_for(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of tokens ``[start, end)`` of a request whose blocks are ``block_ids``.

    ``slot(t) = block_ids[t // block_size] * block_size + t % block_size``.

    Raises:
        ValueError: the blocks do not cover ``end`` tokens.
    """
    if end > len(block_ids) * block_size:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} do not cover {end} tokens")
    t = torch.arange(start, end, dtype=torch.long)
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    return blocks[t // block_size] * block_size + t % block_size


def detect_layout(cache: torch.Tensor, is_cpu_platform: bool) -> str:
    """The layout of a cache handed to a connector's ``register_kv_caches``."""
    if cache.dim() == 4:
        return "cpu" if is_cpu_platform else "packed"
    if cache.dim() == 5 and cache.shape[0] == 2:
        return "flash_attn"
    if cache.dim() == 5 and cache.shape[1] == 2:
        return "flashinfer"
    raise ValueError(f"unrecognised paged KV cache shape {tuple(cache.shape)}")


class ClaimedLayerWrites:
    """A blend's per-layer callback in the vLLM worker (``on_layer`` of
    :meth:`blend.engine.BlendEngine.blend_steps`): each layer's claimed rows ``[start, end)``
    go into vLLM's paged cache at ``slot_mapping``, and whether they are finite is kept on the
    device (an ``and`` per layer, no host sync) until :meth:`all_finite` reads it once.

    Who calls it: :class:`cluster.vllm.worker.KVBlendWorker` for every blend load (and the
    full prefill a failed load falls back to), writing through the attention backend's own
    cache update; ``kvblend bench gpu`` times the same callback over a paged cache of its own,
    written by :func:`blend.kernels.paged.scatter_paged` (no vLLM on the GPU machine).

    Args:
        start, end: the claimed token rows (vLLM computed ``[0, start)`` itself).
        slot_mapping: ``[end - start]`` int64 slots of those rows (moved to the KV's device at
            the first layer, once).
        write: ``write(layer_idx, kv, slot_mapping)`` with ``kv`` ``[2, end - start, H, D]``.
    """

    def __init__(self, start: int, end: int, slot_mapping: torch.Tensor, write) -> None:
        self.start, self.end, self.slot_mapping, self._write = int(start), int(end), slot_mapping, write
        self._finite: torch.Tensor | None = None  # [] bool on the model's device

    def __call__(self, layer_idx: int, kv: torch.Tensor) -> None:
        """One layer's final KV ``[2, T, H, D]`` (``T >= end``).

        Raises:
            RuntimeError: fewer rows than claimed."""
        if kv.shape[1] < self.end:
            raise RuntimeError(f"engine produced {kv.shape[1]} rows, {self.end} claimed")
        if self.slot_mapping.device != kv.device:  # once a request: vLLM's slots come on the host, and
            self.slot_mapping = self.slot_mapping.to(kv.device)  # a copy per layer was a host wait per layer
        rows = kv[:, self.start:self.end]
        ok = torch.isfinite(rows).all()
        if self._finite is None:
            self._finite = ok.clone()
        else:
            self._finite.logical_and_(ok)
        self._write(layer_idx, rows, self.slot_mapping)

    def all_finite(self) -> bool:
        """Every row written since the last :meth:`reset` was finite (one host sync; True when
        nothing was written)."""
        return self._finite is None or bool(self._finite)

    def reset(self) -> None:
        """Forget what was written (before a full prefill rewrites every layer)."""
        self._finite = None
