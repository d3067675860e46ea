"""The cluster client API, and an in-process reference implementation.

``CacheClient`` (in :mod:`cluster.cache.client`, over Ray shard actors) and
:class:`LocalCacheClient` (below, one process, no Ray) both implement blend's
:class:`~blend.protocols.KVSource` and :class:`~blend.protocols.KVSink` plus the
administrative calls here. Contract, common to both:

* ``lookup(keys)`` — one round trip for a batch; returns :class:`~blend.protocols.ChunkMeta`
  or None per key and starts promoting the hits into host memory (prefetch).
* ``fetch_layer(keys, layer_idx)`` — a future of ``[2, T, H, D]`` tensors (None where a chunk
  cannot be read); never raises for cache faults.
* ``put(key, kv, positions)`` — asynchronous, idempotent; ``kv`` is ``[L, 2, T, H, D]``.
* ``flush(timeout_s)`` — wait for pending puts; True when all finished.
* ``contains(keys)``, ``delete(keys)``, ``stats()``.

Failure behaviour: a dead or slow shard or tier is a miss and a counter, never an exception.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from blend.protocols import ChunkMeta
from tiers.codec import encode_kv, layer_tensor  # noqa: F401  (LocalCacheClient's codec)
from tiers.format import HEADER_PROBE_BYTES, FormatError, decode_layer, parse_header
from tiers.keys import ChunkKey
from tiers.tier import MemoryTier, Tier


def local_client(config, device: str | torch.device = "cpu") -> LocalCacheClient:
    """The machine-local cache used when no Ray cluster is reachable.

    A :class:`~tiers.disk.DiskTier` in ``shared`` mode under ``<cache_dir>/local-cache`` (or
    ``disk_path``/local), so that every process of this machine — a vLLM engine's scheduler
    and worker processes, ``kvblend ingest`` — sees the chunks the others stored.
    """
    import os

    from cluster.config import cache_dir
    from tiers.disk import DiskTier

    root = config.tiers.disk_path or cache_dir(config)
    tier = DiskTier(os.path.join(root, "local-cache"), int(config.tiers.disk_size_gib * 2**30),
                    config.tiers.eviction_policy, name="disk", shared=True)
    return LocalCacheClient(tier, device=device, compress=config.tiers.compression == "lz4")


class LocalCacheClient:
    """Cache client over tiers in this process (no Ray): tests, and a process without Ray.

    Args:
        tier: any :class:`~tiers.tier.Tier` (default: a 1 GiB :class:`MemoryTier`).
        device: device of tensors returned by ``fetch_layer``.
    """

    def __init__(self, tier: Tier | None = None, device: str | torch.device = "cpu",
                 compress: bool = False) -> None:
        self.tier = tier if tier is not None else MemoryTier(1 << 30, name="host")
        self.device = torch.device(device)
        self.compress = compress
        self._lock = threading.Lock()
        self.counters = {"lookups": 0, "hits": 0, "misses": 0, "read_errors": 0, "puts": 0}

    def _header(self, key: ChunkKey):
        ranges = self.tier.get_ranges(key, [(0, HEADER_PROBE_BYTES)])
        if ranges is None:
            obj = self.tier.get(key)  # small object: shorter than the probe
            if obj is None:
                return None
            buf = obj
        else:
            buf = ranges[0]
        try:
            return parse_header(buf, expected_key=key)
        except FormatError:
            self.counters["read_errors"] += 1
            return None

    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        out: list[ChunkMeta | None] = []
        for key in keys:
            h = self._header(key)
            self.counters["lookups"] += 1
            if h is None:
                self.counters["misses"] += 1
                out.append(None)
            else:
                self.counters["hits"] += 1
                out.append(ChunkMeta(key, h.num_tokens, tuple(h.position_list()), self.tier.name))
        return out

    def read_layer(self, key: ChunkKey, layer_idx: int) -> torch.Tensor | None:
        h = self._header(key)
        if h is None or not 0 <= layer_idx < h.num_layers:
            return None
        e = h.layers[layer_idx]
        got = self.tier.get_ranges(key, [(e.offset, e.stored_len)])
        if got is None:
            return None
        try:
            raw = decode_layer(h, layer_idx, got[0])
        except FormatError:
            self.counters["read_errors"] += 1
            return None
        return layer_tensor(raw, h.layer_shape, h.dtype).to(self.device)

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future:
        fut: Future = Future()
        fut.set_result([self.read_layer(k, layer_idx) for k in keys])
        return fut

    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> None:
        self.counters["puts"] += 1
        self.tier.put(key, encode_kv(key, kv, positions, compress=self.compress))

    def flush(self, timeout_s: float = 60.0) -> bool:
        return True

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.tier.contains(keys)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        return self.tier.delete(keys)

    def stats(self) -> dict:
        return {"client": dict(self.counters), "tiers": {self.tier.name: self.tier.stats()}}
