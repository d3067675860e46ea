"""Host-to-device copies straight from memory the copy engine reads, several layers at a time.

:class:`tiers.staging.StagedSource` fills a pinned slot and copies a layer at once when a
request's chunks sit in ordinary host memory. Two kinds of chunk skip that fill: those in its
pinned store (:mod:`tiers.pinned`) and those whose reader hands out views of memory registered
with CUDA (:class:`Readable`: the cache agent's shared-memory arena, :mod:`cluster.cache.arena`).
Their layers go to the device with no host copy, one copy per chunk — and per *group* of
consecutive layers, because a chunk's raw layers lie back to back in both (a chunk object's
payload, a pinned chunk's buffer): :func:`group_size` layers of 2 MiB (512 tokens of an 8B
model) make one 8 MiB copy, which the copy engine moves at its pinned rate, where 2 MiB
copies issued one by one from Python ran at 25-38 GB/s against 55 GB/s (H200, 2026-12-04).

Device memory: one group of layers per copy, inside the staging source's ``max_ahead``
bound. Lifetimes: each entry's ``last_copy`` is the event of the last copy that read it; its
owner keeps the memory until that event completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch

from tiers.codec import TORCH_DTYPES, LayerBatch

#: bytes one copy of a chunk's layers should reach (fewer, larger copies: the copy engine's rate)
GROUP_BYTES = 8 << 20


class Readable:
    """A chunk's layer views (uint8, one per layer) in memory the copy engine reads;
    ``last_copy`` is the event of the last copy that read them."""

    __slots__ = ("layers", "last_copy")

    def __init__(self, layers: Sequence[np.ndarray]) -> None:
        self.layers, self.last_copy = list(layers), None


def group_size(headers, max_ahead: int) -> int:
    """Layers per copy: enough for :data:`GROUP_BYTES` per chunk, at most ``max_ahead``."""
    sizes = [h.layer_nbytes for h in headers if h is not None]
    if not sizes:
        return 1
    return max(1, min(max_ahead, -(-GROUP_BYTES // max(1, min(sizes)))))


def _spans(layers: Sequence[np.ndarray], layer_idxs: Sequence[int]):
    """``(position in the group, array)`` runs of the layers of ``layer_idxs`` that lie back to
    back in memory (one array over each run: a view of the run's first layer, extended)."""
    j = 0
    while j < len(layer_idxs):
        first = layers[layer_idxs[j]]
        end, k = int(first.ctypes.data) + first.nbytes, j + 1
        while k < len(layer_idxs):
            nxt = layers[layer_idxs[k]]
            if int(nxt.ctypes.data) != end or nxt.nbytes != first.nbytes:
                break
            end += nxt.nbytes
            k += 1
        n = end - int(first.ctypes.data)
        yield j, (first if k == j + 1 else np.lib.stride_tricks.as_strided(first, shape=(n,), strides=(1,)))
        j = k


def copy_group(entries, headers, layer_idxs: Sequence[int], device: torch.device, copy_stream,
               consumer_stream) -> tuple[list[LayerBatch], tuple | None]:
    """Layers ``layer_idxs`` of every chunk with an entry (a pinned chunk or a
    :class:`Readable`), one copy per chunk and run of adjacent layers.

    Returns:
        One :class:`~tiers.codec.LayerBatch` per layer (per chunk ``[2, T, H, D]`` on
        ``device``, None where it has no entry; on CUDA its ``ready`` event is the group's
        copy), and ``(start event, end event, bytes)`` of the copy (None off CUDA or for no
        bytes).
    """
    num = len(layer_idxs)
    out = [LayerBatch([None] * len(headers)) for _ in range(num)]
    sizes = [0 if e is None or h is None else num * h.layer_nbytes for e, h in zip(entries, headers, strict=True)]
    total = sum(sizes)
    if total == 0:
        return out, None
    cuda = device.type == "cuda"
    timing = None
    with torch.cuda.stream(copy_stream) if cuda else nullcontext():
        dev = torch.empty(total, dtype=torch.uint8, device=device)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        off = 0
        bases = []
        for e, h, size in zip(entries, headers, sizes, strict=True):
            bases.append(off)
            if size:
                lb = h.layer_nbytes
                for pos, arr in _spans(e.layers, layer_idxs):
                    dev[off + pos * lb:off + pos * lb + arr.nbytes].copy_(torch.from_numpy(arr), non_blocking=cuda)
            off += size
        if cuda:
            end.record()
    if cuda:
        dev.record_stream(consumer_stream)  # freed only after the consumer's uses
        for e in entries:
            if e is not None:
                e.last_copy = end
        for batch in out:
            batch.ready = end
        timing = (start, end, total)
    for i, (h, size, base) in enumerate(zip(headers, sizes, bases, strict=True)):
        if size:
            lb = h.layer_nbytes
            for j in range(num):
                out[j][i] = dev[base + j * lb:base + (j + 1) * lb].view(TORCH_DTYPES[h.dtype]).view(h.layer_shape)
    return out, timing
