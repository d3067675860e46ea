"""The gpu tier: a device-resident pool of hot chunks' decoded KV, inside the vLLM worker.

Unlike the byte tiers, a :class:`GpuTier` holds **decoded tensors**, not chunk objects:
HBM belongs to the worker process, and the blend engine wants a layer as a ready
``[2, T, H, D]`` tensor with no decode step. It is therefore not a :class:`tiers.tier.Tier`
(no byte ranges); :meth:`GpuTier.load` fills it from any byte tier through
:mod:`tiers.reader`.

Axis letters: ``L`` layers, ``T`` tokens of the chunk, ``H`` KV heads, ``D`` head dim; axis
1 of a chunk is K then V. Eviction is LRU/LFU by bytes with pins
(:class:`tiers.eviction.EvictionIndex`).

Failure behaviour: no I/O, so no timeouts. A miss is ``None``/``False``. A ``put`` that cannot
fit without evicting pinned chunks returns False; a device out-of-memory error on
allocation is a failed put (``False``, counted in ``errors``), never an exception.
``load`` turns any tier fault into False (see :mod:`tiers.reader`). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from tiers.codec import TORCH_DTYPES
from tiers.eviction import EvictionIndex
from tiers.keys import ChunkKey
from tiers.reader import ReadCounters, read_header, read_layers
from tiers.tier import Tier

_COUNTERS = ("hits", "misses", "errors", "puts", "evictions", "bytes_read", "bytes_written")


class GpuTier:
    """Decoded chunk KV on ``device`` (see module docstring).

    Args:
        capacity_bytes: most bytes of KV tensors held.
        device: where tensors live (``"cuda:0"`` in a worker; ``"cpu"`` in tests).
        policy: ``"lru"`` or ``"lfu"``.
        name: tier name in stats.
    """

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cpu",
                 policy: str = "lru", name: str = "gpu") -> None:
        self.name = name
        self.device = torch.device(device)
        self._index = EvictionIndex(capacity_bytes, policy)
        self._data: dict[ChunkKey, tuple[torch.Tensor, tuple[int, ...] | None]] = {}
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._staging: torch.Tensor | None = None
        self._staging_lock = threading.Lock()

    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> bool:
        """Store a copy of ``kv`` on the device (first wins; True if already present).

        Shapes:
            kv: ``[L, 2, T, H, D]`` any dtype/device (copied to ``self.device``, contiguous).

        Returns:
            False when it cannot fit without evicting pinned chunks, or allocation failed.

        Raises:
            ValueError: ``kv`` is not 5-D with axis 1 of size 2, or ``positions`` is not T long.
        """
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ValueError(f"kv must be [L, 2, T, H, D], got {tuple(kv.shape)}")
        if positions is not None and len(positions) != kv.shape[2]:
            raise ValueError(f"{len(positions)} positions for {kv.shape[2]} tokens")
        return self._store(key, tuple(kv.shape), kv.dtype, lambda dst: (dst.copy_(kv), True)[1],
                           tuple(positions) if positions is not None else None)

    def _store(self, key: ChunkKey, shape: tuple[int, ...], dtype: torch.dtype, fill,
               positions: tuple[int, ...] | None) -> bool:
        """Reserve room, allocate ``shape``/``dtype`` on the device, ``fill(dst) -> bool``
        it, and publish it; a failed fill or allocation releases the room."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            if key in self._data:
                return True
            victims = self._index.admit(key, nbytes)
            if victims is None:
                return False
            self._index.pin(key)  # reserved: nobody evicts it while we fill it
            for v in victims:
                self._data.pop(v, None)
            self._stats["evictions"] += len(victims)
        stored = None
        try:
            stored = torch.empty(shape, dtype=dtype, device=self.device)
            if not fill(stored):
                stored = None
        except (RuntimeError, torch.OutOfMemoryError):
            stored = None
            with self._lock:
                self._stats["errors"] += 1
        with self._lock:
            self._index.unpin(key)
            if stored is None:
                self._index.remove(key)
                return False
            self._data[key] = (stored, positions)
            self._stats["puts"] += 1
            self._stats["bytes_written"] += nbytes
        return True

    def get(self, key: ChunkKey) -> torch.Tensor | None:
        """The whole chunk ``[L, 2, T, H, D]`` (the stored tensor itself: callers must not
        modify it; rotate a copy), or None."""
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                self._stats["misses"] += 1
                return None
            self._index.touch(key)
            self._stats["hits"] += 1
            self._stats["bytes_read"] += entry[0].numel() * entry[0].element_size()
            return entry[0]

    def get_layer(self, key: ChunkKey, layer_idx: int) -> torch.Tensor | None:
        """Layer ``layer_idx`` as a ``[2, T, H, D]`` view into the pool (callers must not
        modify it: copy before rotating), or None (absent or index out of range)."""
        kv = self.get(key)
        if kv is None or not 0 <= layer_idx < kv.shape[0]:
            return None
        return kv[layer_idx]

    def positions(self, key: ChunkKey) -> tuple[int, ...] | None:
        """Positions K was rotated at (None = canonical ``0..T-1`` or absent)."""
        with self._lock:
            entry = self._data.get(key)
            return None if entry is None else entry[1]

    def load(self, tier: Tier, key: ChunkKey, counters: ReadCounters | None = None) -> bool:
        """Read all layers of ``key`` from a byte ``tier`` into the pool.

        On ``device="cpu"`` the layers are read straight into the pooled tensor; on a GPU
        they go through one reusable host staging buffer (page-locked, so the host-to-device
        copy runs at full PCIe/NVLink speed; loads through it are serialized) and one copy
        to the device. Returns False on a miss or a corrupt object (see :mod:`tiers.reader`)
        or when the pool is full.
        """
        if self.contains([key])[0]:
            return True
        header = read_header(tier, key, counters)
        if header is None or header.dtype not in TORCH_DTYPES:
            return False
        num_layers = header.num_layers
        shape = (num_layers, *header.layer_shape)  # [L, 2, T, H, D]
        dtype = TORCH_DTYPES[header.dtype]
        positions = header.position_list()
        canonical = positions == list(range(header.num_tokens))

        def read_into(flat_u8: torch.Tensor) -> bool:
            raw = flat_u8.view(num_layers, -1).numpy()
            return read_layers(tier, key, range(num_layers), [raw[i] for i in range(num_layers)],
                               header=header, counters=counters) is not None

        def fill(dst: torch.Tensor) -> bool:
            if dst.device.type == "cpu":
                return read_into(dst.view(torch.uint8).view(-1))
            with self._staging_lock:
                staging = self._staging_buffer(dst.numel() * dst.element_size())
                if not read_into(staging):
                    return False
                dst.view(torch.uint8).view(-1).copy_(staging)
                return True

        return self._store(key, shape, dtype, fill, None if canonical else tuple(positions))

    def _staging_buffer(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of ``nbytes`` (page-locked when CUDA is available); grown on
        demand and reused. Caller holds ``_staging_lock``."""
        if self._staging is None or self._staging.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._staging = buf.pin_memory() if torch.cuda.is_available() else buf
        return self._staging[:nbytes]

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                if self._data.pop(k, None) is not None:
                    self._index.remove(k)
                    n += 1
        return n

    def pin(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Pin present keys against eviction (nested); returns which were present."""
        with self._lock:
            return [k in self._data and self._index.pin(k) for k in keys]

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                self._index.unpin(k)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return [k for k in self._index.keys() if k in self._data]

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._stats, "bytes_used": self._index.used_bytes,
                    "capacity_bytes": self._index.capacity_bytes, "num_chunks": len(self._data)}
