"""Where the GPU staging pipeline (:mod:`tiers.staging`) reads chunk layers from.

:class:`HostLayers` is the contract: ``headers`` once per request (a Ray client maps the
request's objects there), ``layer_into`` per chunk and layer (on io threads), and the optional
``layer_views`` fast path (zero-copy views of layers checked when they entered host memory).
The cache clients implement it (``host_layers()``); :class:`TierLayers` adapts any byte tier.
Checksums are checked where they protect something: a :class:`tiers.host.HostTier`'s objects
were checked when they entered it (copied unchecked), disk and lz4 layers as they are read,
any other tier's on every read. Failure behaviour: a miss is None/False, never an exception.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tiers.codec import TORCH_DTYPES
from tiers.format import CODEC_RAW, ChunkHeader
from tiers.keys import ChunkKey
from tiers.reader import ReadCounters, read_header, read_layers

log = logging.getLogger(__name__)


class HostLayers(Protocol):
    """Chunk layers in host memory (or on disk), for :class:`StagedSource`.

    ``headers`` runs once per request on the staging thread (it may map objects: a Ray
    client asks its shards here); ``layer_into`` runs on io threads, concurrently.
    """

    name: str

    def headers(self, keys: Sequence[ChunkKey]) -> list[ChunkHeader | None]:
        """The validated header of each key's object, or None for a miss."""
        ...

    def layer_into(self, key: ChunkKey, header: ChunkHeader, layer_idx: int, out: np.ndarray) -> bool:
        """Write layer ``layer_idx``'s raw ``[2, T, H, D]`` bytes into ``out`` (uint8, exactly
        ``header.layer_nbytes``); False on a miss or a corrupt layer (never raises)."""
        ...

    def layer_views(self, key: ChunkKey, header: ChunkHeader) -> list | None:
        """Optional fast path (runs with ``headers``, once per request): zero-copy, read-only
        uint8 views of every layer's raw bytes, already checked (they entered host memory
        checked), or None when the object has none (on disk, lz4 layers, not checked):
        then ``layer_into`` reads it."""
        ...


class TierLayers:
    """:class:`HostLayers` over one byte tier, read by :func:`tiers.reader.read_layers`:
    disk layers are checked as they land, a :class:`tiers.host.HostTier`'s layers were
    checked when they entered it (copied without hashing again), any other tier's are
    checked on every read.
    """

    def __init__(self, tier, counters: ReadCounters | None = None) -> None:
        self.tier = tier
        self.name = getattr(tier, "name", type(tier).__name__)
        self.counters = counters if counters is not None else ReadCounters()

    def headers(self, keys: Sequence[ChunkKey]) -> list[ChunkHeader | None]:
        out = []
        for key in keys:
            h = read_header(self.tier, key, self.counters)
            out.append(h if h is not None and h.dtype in TORCH_DTYPES else None)
        return out

    def layer_views(self, key: ChunkKey, header: ChunkHeader) -> list | None:
        """Views of a :class:`tiers.host.HostTier` object whose every layer is raw and was
        checked on entry against this very header; None for any other tier or object."""
        verified = getattr(self.tier, "get_ranges_verified", None)
        if verified is None or any(e.codec != CODEC_RAW for e in header.layers):
            return None
        got = verified(key, [(e.offset, e.stored_len) for e in header.layers])
        if got is None or got[1] is None or got[1].layers != header.layers:
            return None
        return list(got[0])

    def layer_into(self, key: ChunkKey, header: ChunkHeader, layer_idx: int, out: np.ndarray) -> bool:
        try:
            return read_layers(self.tier, key, [layer_idx], [out], header=header,
                               counters=self.counters) is not None
        except Exception as err:  # noqa: BLE001 - a broken tier is a miss, never a failed request
            log.warning("%s: read of layer %d of %s failed (%s: %s)", self.name, layer_idx, key,
                        type(err).__name__, err)
            self.counters.add("misses")
            return False
