"""The client's chunk layers in host memory, for the GPU worker's staging pipeline.

:class:`tiers.staging.StagedSource` copies layers from a :class:`tiers.host_layers.HostLayers`
into pinned memory and then onto the GPU. :class:`ClientHostLayers` is that reader over a
:class:`~cluster.cache.client.CacheClient`, whatever its transport: ``headers`` (once per
request, on the staging thread) holds the request's objects exactly as ``fetch_layers`` does
(:meth:`~cluster.cache.client.CacheClient.map_for_read`: mapped zero-copy from the node's object
store, or in the agent's shared-memory arena, which a CUDA worker registers so that the copy
engine reads it directly) and ``layer_views`` hands the staging thread zero-copy views of an
object's raw layers (one multi-threaded copy per chunk and layer into the pinned slot, no Python
per byte), and ``layer_into`` decodes the rest (lz4 layers, chunks read from a shared tier).

Checksums: an object from a shard's host memory entered it only after the shard checked every
layer (``CacheShard.put`` and promotions validate the whole object), so its raw layers are
copied unchecked; any other object (``checked`` False: a machine-local tier's) has each layer
checked here, tags included when a key is set, and is never handed out as views; lz4 layers
are checked as they are decoded, and layers read from the shared tiers directly (owner dead)
by :func:`tiers.reader.read_layers`. Failure behaviour: a miss is False/None and the client's
``layer_misses`` counter, never an exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from cluster.cache.headers import arrived
from tiers.format import CODEC_RAW, ChunkHeader, FormatError, check_payload, decode_layer
from tiers.keys import ChunkKey
from tiers.reader import ReadCounters, read_layers

log = logging.getLogger("kvblend.client")


class ClientHostLayers:
    """:class:`tiers.host_layers.HostLayers` over a :class:`~cluster.cache.client.CacheClient`.

    ``headers`` keeps the request's objects (those of its latest call: the one staging thread
    asks for one request at a time) for ``layer_views`` and ``layer_into``; between requests
    the client holds them (its held-object LRU), so this keeps nothing more.
    """

    def __init__(self, client) -> None:
        self.client = client
        self.name = "client"
        self.counters = ReadCounters()
        self._lock = threading.Lock()
        #: key -> the request's held ``(object, header, checked)``, or None (only a shared tier)
        self._held: dict[ChunkKey, tuple | None] = {}

    def headers(self, keys: Sequence[ChunkKey]) -> list[ChunkHeader | None]:
        """Hold the objects of ``keys`` (looked up first where unknown); each one's own header,
        the looked-up header for a chunk only a shared tier holds, or None."""
        client, keys = self.client, list(keys)
        entries, held = client.map_for_read(keys)
        deadline = time.monotonic() + client.fetch_timeout_s
        out: list[ChunkHeader | None] = []
        mine: dict[ChunkKey, tuple | None] = {}
        for k, e, h in zip(keys, entries, held, strict=True):
            if h is not None and not arrived(h, None, deadline):  # staged whole: all of it there
                h, e = None, None
                client.count("timeouts")
            if h is not None or (e is not None and client.shared_tiers()):
                mine[k] = h
            out.append(h[1] if h is not None else e.header if k in mine else None)
        with self._lock:
            self._held = mine
        return out

    def forget(self) -> None:
        """Drop every mapped object kept here (the next request maps its own anew)."""
        with self._lock:
            self._held = {}

    def use_device(self, device) -> None:
        """A CUDA staging source reads this: the memory the client's objects arrive in is
        registered with CUDA where a transport can (the agent's arena)."""
        for t in self.client.transports:
            hook = getattr(t, "use_cuda", None)
            if hook is not None:
                hook()

    def views_device_readable(self, key: ChunkKey) -> bool:
        """Whether ``key``'s views (from :meth:`layer_views`) lie in memory the copy engine
        reads directly (the agent's registered arena): then they go to the GPU unstaged."""
        with self._lock:
            h = self._held.get(key)
        return h is not None and h[2] and any(getattr(t, "device_readable", lambda a: False)(h[0])
                                               for t in self.client.transports)

    def layer_views(self, key: ChunkKey, header: ChunkHeader) -> list[np.ndarray] | None:
        """Zero-copy views of a held object's raw layers (checked at the shard); None for an
        object with lz4 layers or unchecked ones (``layer_into`` reads those)."""
        with self._lock:
            h = self._held.get(key)
        if h is None or not h[2] or any(e.codec != CODEC_RAW for e in header.layers):
            return None
        arr = h[0]
        views = [arr[e.offset:e.offset + e.stored_len] for e in header.layers]
        if any(v.nbytes != e.stored_len for v, e in zip(views, header.layers, strict=True)):
            return None
        return views

    def layer_into(self, key: ChunkKey, header: ChunkHeader, layer_idx: int, out: np.ndarray) -> bool:
        with self._lock:
            present = key in self._held
            h = self._held.get(key)
        arr, unchecked = (None, False) if h is None else (h[0], not h[2])
        ok = False
        try:
            if not present or not 0 <= layer_idx < header.num_layers:
                raise FormatError(f"layer {layer_idx} of {key} was not prepared")
            if arr is not None:
                e = header.layers[layer_idx]
                payload = arr[e.offset:e.offset + e.stored_len]
                if e.codec == CODEC_RAW:
                    if payload.nbytes != e.stored_len or out.nbytes != e.stored_len:
                        raise FormatError(f"layer {layer_idx}: {payload.nbytes} bytes, expected {e.stored_len}")
                    if unchecked:  # not from a shard's host memory: its checksum, or tag
                        check_payload(header, layer_idx, payload)
                    np.copyto(out, payload)  # no GIL while copying; checked at the shard
                else:  # host memory: checked as it entered; any other: tag too
                    decode_layer(header, layer_idx, payload, memoryview(out), authenticate=unchecked)
                ok = True
            else:
                for tier in self.client.shared_tiers():
                    if read_layers(tier, key, [layer_idx], [out], counters=self.counters) is not None:
                        self.client.count("direct_reads")
                        ok = True
                        break
        except (FormatError, ValueError) as err:
            log.debug("layer %d of %s rejected: %s", layer_idx, key, err)
            self.client.count("read_errors")
        except Exception as err:  # noqa: BLE001 - a broken tier is a miss, never a failed request
            log.warning("read of layer %d of %s failed (%s: %s)", layer_idx, key, type(err).__name__, err)
        self.counters.add("hits" if ok else "misses")
        self.client.count("layer_reads" if ok else "layer_misses")
        return ok
