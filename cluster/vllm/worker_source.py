"""The vLLM worker's KV source: its gpu tier of hot chunks in front of the cluster client.

The blend engine reads cached chunks layer by layer (:class:`blend.protocols.KVSource`). In a
worker, :class:`WorkerKVSource` answers a layer from the worker's own
:class:`tiers.gpu.GpuTier` (decoded ``[2, T, H, D]`` tensors on the model's device — host
memory on the CPU backend) when the chunk is there, and from the cluster client otherwise.
Chunks read through the client are collected layer by layer and, once every layer has
passed, put into the gpu tier, so the next request on this worker that uses them reads no
byte from a shard. Canonical KV the worker computes for storing goes in too
(:meth:`WorkerKVSource.remember`).

Sized by ``gpu_size_gib`` (0 = no gpu tier: every layer comes from the client). Faults: a
gpu-tier miss falls through to the client; a client fault is the client's ``None``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from tiers.gpu import GpuTier
from tiers.keys import ChunkKey


class WorkerKVSource:
    """:class:`blend.protocols.KVSource` over ``gpu`` (may be None) and ``client``.

    Args:
        client: the cluster client (``lookup``, ``fetch_layer``).
        gpu: the worker's gpu tier, or None.
        num_layers: layers per chunk (a chunk enters the gpu tier after its last layer).
    """

    def __init__(self, client, gpu: GpuTier | None, num_layers: int) -> None:
        self.client = client
        self.gpu = gpu
        self.num_layers = num_layers
        self._partial: dict[ChunkKey, list[torch.Tensor | None]] = {}
        self._lock = threading.Lock()

    def lookup(self, keys: Sequence[ChunkKey]):
        return self.client.lookup(keys)

    def gpu_hits(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys`` the gpu tier holds now."""
        return sum(self.gpu.contains(list(keys))) if self.gpu is not None and keys else 0

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future:
        """Layer ``layer_idx`` of each chunk: ``[2, T_i, H, D]`` or None (see the protocol)."""
        keys = list(keys)
        local = [self.gpu.get_layer(k, layer_idx) if self.gpu is not None else None for k in keys]
        missing = [i for i, t in enumerate(local) if t is None]
        out: Future = Future()
        if not missing:
            out.set_result(local)
            return out
        inner = self.client.fetch_layer([keys[i] for i in missing], layer_idx)

        def done(fut: Future) -> None:
            try:
                got = list(fut.result())
            except Exception:  # noqa: BLE001 - a client fault is a miss
                got = [None] * len(missing)
            result = list(local)
            for i, t in zip(missing, got, strict=True):
                result[i] = t
                if t is not None and self.gpu is not None:
                    self._collect(keys[i], layer_idx, t)
            out.set_result(result)

        inner.add_done_callback(done)
        return out

    def _collect(self, key: ChunkKey, layer_idx: int, kv: torch.Tensor) -> None:
        with self._lock:
            layers = self._partial.setdefault(key, [None] * self.num_layers)
            layers[layer_idx] = kv
            if any(t is None for t in layers):
                if len(self._partial) > 4096:  # requests that stopped early: forget the oldest
                    self._partial.pop(next(iter(self._partial)))
                return
            del self._partial[key]
        self.gpu.put(key, torch.stack(layers))

    def remember(self, key: ChunkKey, kv: torch.Tensor) -> None:
        """Put a chunk the worker computed (``[L, 2, T, H, D]``) into the gpu tier."""
        if self.gpu is not None:
            self.gpu.put(key, kv)
