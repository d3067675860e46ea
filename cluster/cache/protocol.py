"""``CacheClientProtocol``: the contract of the cache client, whatever its transports.

Implementation: :class:`cluster.cache.client.CacheClient`, over a chain of transports (the Ray
shard actors from this process, a cache agent process, a tier in this process:
:class:`cluster.cache.local.LocalCacheClient` is the client over one such tier);
:func:`cluster.cache.factory.make_client` builds the chain. It extends blend's
:class:`~blend.protocols.KVSource` and :class:`~blend.protocols.KVSink` with the calls that
ingest, the connector's store path and the benchmarks use. Who calls what::

    scheduler side    lookup(keys)               one round trip for the batch; starts
                                                 promoting the hits into host memory
    worker side       fetch_layers(keys, ls)     every layer a blend needs, at its start
                      fetch_layer(keys, l)       one layer (tools, tests)
                      host_layers()              the bytes a CUDA worker stages through
                                                 pinned memory (tiers.staging)
    after a request   contains(keys)             which segments still need storing
                      put(key, kv, positions)    asynchronous, idempotent
                      flush(timeout_s)           before the process reports the stores done
    operators, tests  delete(keys), stats()
    the owner, last   close()

Shapes (axis letters of :mod:`blend.protocols`: L layers, T tokens, H KV heads, D head dim):
``put`` takes ``kv`` ``[L, 2, T, H, D]`` (K then V on axis 1) in bfloat16, float16 or float32
(:data:`tiers.codec.TORCH_DTYPES`), on any device; ``fetch_layer`` returns ``[2, T_i, H, D]``
per chunk, in the stored dtype, on the client's ``device``.

Failure behaviour: no call raises for a cache fault. A dead, slow or restarting shard or tier,
a lost object, a corrupted, truncated or foreign object is a miss (``None``, ``False``, 0) and
a counter in ``stats()``; a put that cannot be stored is dropped (a future miss). Caller
mistakes raise at the call: ``TypeError`` for a key that is not a
:class:`~tiers.keys.ChunkKey`, ``ValueError`` for a malformed ``kv`` or a negative
``layer_idx``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from blend.protocols import ChunkMeta, KVSink, KVSource
from tiers.keys import ChunkKey

if TYPE_CHECKING:
    import torch

    from tiers.host_layers import HostLayers


@runtime_checkable
class CacheClientProtocol(KVSource, KVSink, Protocol):
    """A chunk cache client: blend's KV source and sink plus administration (see module
    docstring for the lifecycle, shapes and failure behaviour). Safe to call from several
    threads."""

    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """Which keys are cached, in one round trip for the batch.

        Returns:
            Per key a :class:`~blend.protocols.ChunkMeta` (``tier`` = the tier that answered)
            or None (absent, unreadable, or its owner did not answer).

        Raises:
            TypeError: a key that is not a :class:`~tiers.keys.ChunkKey`.
        """
        ...

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future[list[torch.Tensor | None]]:
        """Layer ``layer_idx`` of each chunk.

        Shapes:
            The future's list holds, per key, ``[2, T_i, H, D]`` (K then V, K rotated at the
            chunk's stored positions) in the stored dtype on the client's device, or None
            where the chunk cannot be read or has no layer ``layer_idx``. The future never
            carries an exception.

        Raises:
            ValueError: ``layer_idx < 0`` (at the call, not through the future).
        """
        ...

    def host_layers(self) -> HostLayers:
        """This client's chunk layers as host bytes, for :class:`tiers.staging.StagedSource`
        (the CUDA worker's source copies them into pinned memory, then onto the GPU)."""
        ...

    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> None:
        """Store ``kv`` ``[L, 2, T, H, D]`` under ``key``, its K rotated at ``positions``
        (default ``0..T-1``). Asynchronous and idempotent (the first object stored under a
        key wins); ``kv`` is copied before returning.

        Raises:
            TypeError: ``key`` is not a :class:`~tiers.keys.ChunkKey`.
            ValueError: ``kv`` is not 5-D with axis 1 of size 2, or its dtype is unsupported.
        """
        ...

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait up to ``timeout_s`` seconds for this client's pending puts; True when all
        finished (stored or refused), False on timeout."""
        ...

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is stored (False where its store does not answer); promotes
        nothing."""
        ...

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove keys from every tier that holds them; returns how many were present
        (where the store answered)."""
        ...

    def stats(self) -> dict:
        """``{'client': {counter: count}, ...}``: ``client`` holds this client's cumulative
        event counts since construction (at least ``lookups``, ``hits``, ``misses``,
        ``read_errors``, ``puts``); the other entries describe the stores behind it
        (``'shards'`` over Ray, ``'tiers'`` over a local tier, ``'arena'`` and ``'agent'``
        over a cache agent). JSON-able."""
        ...

    def close(self) -> None:
        """Release the client's threads and connections; ``fetch_layer`` must not be called
        afterwards. Puts already sent are not lost by closing."""
        ...
