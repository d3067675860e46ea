"""The vLLM worker's KV source: its gpu tier of hot chunks in front of the cluster client.

The blend engine asks for every cached layer of a request at once
(:meth:`blend.protocols.KVSource.fetch_layers`). In a worker, :class:`WorkerKVSource`
answers a chunk from the worker's own :class:`tiers.gpu.GpuTier` (decoded ``[2, T, H, D]``
tensors on the model's device; host memory on the CPU backend) when it is there, and from
the cluster client's bytes otherwise:

* on a CUDA device through :class:`tiers.staging.StagedSource` over the client's
  ``host_layers()``: each layer's chunks are copied into pinned memory by io threads and
  moved by one host-to-device copy on a side stream, whose event the engine's stream waits
  on (transfer overlaps recompute; CacheBlend, Yao et al., EuroSys 2025, §5);
* on the CPU straight from the client (``fetch_layers``: no copy engine to overlap with).

:func:`build_worker_source` is the one place that composes it: the vLLM worker and
``kvblend bench gpu`` both call it. The gpu tier holds the canonical KV this worker computed
for storing (:meth:`WorkerKVSource.remember`); chunks read through the client are not added
to it (a blend reads only the layers from its first check layer up, never a whole chunk): on
CUDA the staging source keeps chunks it read in pinned host memory instead
(:mod:`tiers.pinned`), from where they reach the GPU with no host copy.

Sized by ``gpu_size_gib`` (0 = no gpu tier). Faults: a gpu-tier miss falls through to the
client; a client fault is the client's ``None``; every future resolves (a fault is a miss).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from blend.protocols import ChunkMeta
from tiers.codec import LayerBatch
from tiers.gpu import GpuTier
from tiers.keys import ChunkKey
from tiers.staging import StagedSource

#: share of a cache agent's arena one request's objects may fill (the rest: their headers,
#: slot alignment and progress words, and other requests' objects still being read)
ARENA_SHARE = 0.9

log = logging.getLogger("kvblend.connector")


def build_worker_source(client, device: str | torch.device, num_layers: int, *,
                        gpu_bytes: int = 0, policy: str = "lru", pinned_bytes: int = 8 << 30) -> WorkerKVSource:
    """The worker's KV source over ``client`` (see the module docstring).

    Args:
        client: a :class:`cluster.cache.protocol.CacheClientProtocol` (Ray or machine-local).
        device: the model's device; CUDA stages through pinned memory, anything else reads
            the client directly.
        num_layers: layers per chunk.
        gpu_bytes: capacity of the worker's gpu tier (0: none).
        policy: the gpu tier's eviction policy (``lru``/``lfu``).
        pinned_bytes: page-locked host memory for hot chunks (CUDA; ``pinned_size_gib``).
    """
    device = torch.device(device)
    gpu = GpuTier(gpu_bytes, device=device, policy=policy) if gpu_bytes > 0 else None
    reader = (StagedSource(client.host_layers(), device, pinned_bytes=pinned_bytes)
              if device.type == "cuda" else client)
    return WorkerKVSource(client, gpu, num_layers, reader=reader)


class _After(Future):
    """The merged result of a reader future (set by its done callback): asking for it asks
    the reader's future first (a machine-local client reads when asked), cancelling it
    cancels the read."""

    def __init__(self, inner: Future) -> None:
        super().__init__()
        self._inner = inner

    def result(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        try:  # always: a staging source notes that its consumer took the layer
            self._inner.result(timeout)
        except Exception:  # noqa: BLE001 - a reader fault is a miss: the callback says so
            pass
        return super().result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def cancel(self) -> bool:
        done = super().cancel()
        self._inner.cancel()
        return done


class WorkerKVSource:
    """:class:`blend.protocols.KVSource` over ``gpu`` (may be None) and ``client``.

    Args:
        client: the cluster client (``lookup``; ``fetch_layers`` unless ``reader`` is given).
        gpu: the worker's gpu tier, or None.
        num_layers: layers per chunk.
        reader: where layers missing from the gpu tier are read (``fetch_layers``; default
            the client; :func:`build_worker_source` passes a staging source on CUDA).
    """

    def __init__(self, client, gpu: GpuTier | None, num_layers: int, reader=None) -> None:
        self.client = client
        self.gpu = gpu
        self.num_layers = num_layers
        self.reader = reader if reader is not None else client

    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        return self.client.lookup(keys)

    def gpu_hits(self, keys: Sequence[ChunkKey]) -> int:
        """How many of ``keys`` the gpu tier holds now."""
        return len(self.gpu_held(keys))

    def gpu_held(self, keys: Sequence[ChunkKey]) -> set[ChunkKey]:
        """Those of ``keys`` the gpu tier holds now: read with no transfer, so a blend's
        transfer sample leaves them out (:func:`cluster.vllm.cost_samples.samples_of`)."""
        if self.gpu is None or not keys:
            return set()
        return {k for k, held in zip(keys, self.gpu.contains(list(keys)), strict=True) if held}

    def fit_request(self, keys: Sequence[ChunkKey], nbytes: Sequence[int]) -> list[bool]:
        """Which of one request's hit chunks ``keys`` (about ``nbytes`` each, as stored) this
        source can hold at once. Over a cache agent a request's objects must all sit in its
        arena together (:mod:`cluster.cache.agent_objects`; one beyond it is a miss in the
        middle of the blend): chunks in the gpu tier always fit, the others in prompt order
        while :data:`ARENA_SHARE` of the arena has room. All fit without an arena. Called by
        :class:`blend.engine.BlendEngine` before it loads anything."""
        stats = getattr(self.client, "arena_stats", lambda: None)()
        if not stats or not stats.get("arena_bytes"):
            return [True] * len(keys)
        room = int(stats["arena_bytes"] * ARENA_SHARE)
        held = self.gpu.contains(list(keys)) if self.gpu is not None and keys else [False] * len(keys)
        fits = []
        for n, in_gpu in zip(nbytes, held, strict=True):
            ok = bool(in_gpu) or n <= room
            room -= 0 if in_gpu or not ok else n
            fits.append(ok)
        return fits

    def fetch_layers(self, keys: Sequence[ChunkKey], layer_idxs: Sequence[int]) -> list[Future]:
        """Each layer of each chunk, ``[2, T_i, H, D]`` or None (see the protocol): gpu-tier
        chunks at once, the others through ``reader`` (one call for every layer).

        Raises:
            ValueError: a negative layer index.
        """
        keys, layer_idxs = list(keys), list(layer_idxs)
        if any(i < 0 for i in layer_idxs):
            raise ValueError(f"layer_idxs {layer_idxs} must be >= 0")
        # each held chunk's whole [L, 2, T, H, D] once: an eviction meanwhile cannot empty a slot
        held = [self.gpu.get(k) if self.gpu is not None else None for k in keys]
        held = [kv if kv is not None and all(i < kv.shape[0] for i in layer_idxs) else None for kv in held]
        missing = [i for i, kv in enumerate(held) if kv is None]
        inner = self.reader.fetch_layers([keys[i] for i in missing], layer_idxs) if missing else []
        outs: list[Future] = []
        for n, layer_idx in enumerate(layer_idxs):
            local = [None if kv is None else kv[layer_idx] for kv in held]
            if not missing:
                out: Future = Future()
                out.set_result(local)
                outs.append(out)
                continue
            out = _After(inner[n])
            outs.append(out)
            # a weak reference: out holds inner, so a strong one from inner's callback would
            # make a reference cycle, and the layers of both would wait for Python's cyclic
            # collector (the issue 20 soak: the worker's heap grew by 3 GiB over 20 minutes,
            # then fell back at once when a full collection ran)
            inner[n].add_done_callback(
                lambda fut, out=weakref.ref(out), local=local: self._merge(fut, out, local, missing))
        return outs

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future:
        """One layer (see :meth:`fetch_layers`)."""
        return self.fetch_layers(keys, [layer_idx])[0]

    def _merge(self, fut: Future, out_ref: weakref.ref, local: list, missing: list[int]) -> None:
        """Done callback of a reader future: gpu-tier and read chunks in one list into the
        future ``out_ref`` names (never raises; a reader fault or a cancelled read is a miss
        in those slots; nothing to do when its consumer dropped it)."""
        out = out_ref()
        if out is None:
            return
        result = LayerBatch(local)
        try:
            got = fut.result()
            result.ready = getattr(got, "ready", None)
            result.busy_s = getattr(got, "busy_s", None)
            for i, t in zip(missing, list(got), strict=True):
                result[i] = t
        except BaseException:  # noqa: BLE001 - CancelledError included: a miss
            for i in missing:
                result[i] = None
        if out.set_running_or_notify_cancel():
            out.set_result(result)

    def remember(self, key: ChunkKey, kv: torch.Tensor) -> None:
        """Put a chunk the worker computed (``[L, 2, T, H, D]``) into the gpu tier."""
        if self.gpu is not None:
            self.gpu.put(key, kv)

    def close(self) -> None:
        """Stop the staging threads (when this source staged); the client is the caller's."""
        if self.reader is not self.client:
            self.reader.close()
