"""The Ray client's chunk layers in host memory, for the GPU worker's staging pipeline.

:class:`tiers.staging.StagedSource` copies layers from a :class:`tiers.host_layers.HostLayers`
into pinned memory and then onto the GPU. :class:`RayHostLayers` is that reader over a
:class:`~cluster.cache.client.CacheClient`: ``headers`` (once per request, on the staging
thread) maps the request's objects from the node's object store exactly as ``fetch_layer``
does (one ``get_refs`` call per owning shard, one batched ``ray.get``, zero-copy on the same
node) and ``layer_views`` hands the staging thread zero-copy views of a mapped object's raw layers (one
multi-threaded copy per chunk and layer into the pinned slot, no Python per byte), and
``layer_into`` decodes the rest (lz4 layers, chunks read from a shared tier).

Checksums: a mapped object came from a shard's host memory, where it entered only after the
shard checked every layer (``CacheShard.put`` and promotions validate the whole object), so
raw layers are copied unchecked; lz4 layers are checked as they are decoded, and layers read
from the shared tiers directly (owner dead) are checked by :func:`tiers.reader.read_layers`.
The agent's client may map an object the agent read from Redis or S3 (its third item says so):
its layers are checked here, tags included when a key is set, and never handed out as views.
Failure behaviour: a miss is False/None and the client's ``layer_misses`` counter, never an
exception.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from tiers.format import CODEC_RAW, ChunkHeader, FormatError, check_payload, decode_layer
from tiers.keys import ChunkKey
from tiers.reader import ReadCounters, read_layers

log = logging.getLogger("kvblend.client")


class RayHostLayers:
    """:class:`tiers.host_layers.HostLayers` over a :class:`~cluster.cache.client.CacheClient`.

    ``headers`` adds the request's mapped objects to an LRU that ``layer_views`` and
    ``layer_into`` read from (keys are content-addressed: an object never changes under its
    key); objects beyond the client's ``max_mapped_bytes`` are forgotten oldest first, never
    those of the call that just mapped them.
    """

    def __init__(self, client) -> None:
        self.client = client
        self.name = "ray"
        self.counters = ReadCounters()
        self._lock = threading.Lock()
        self._mapped: OrderedDict[ChunkKey, np.ndarray | None] = OrderedDict()
        self._shared: set[ChunkKey] = set()  # mapped objects read from a shared tier (unchecked)

    def headers(self, keys: Sequence[ChunkKey]) -> list[ChunkHeader | None]:
        """Map the objects of ``keys`` (looked up first where unknown); each one's own header,
        the looked-up header for a chunk only a shared tier holds, or None."""
        client, keys = self.client, list(keys)
        entries, arrays = client.map_for_read(keys)
        out: list[ChunkHeader | None] = []
        mapped: dict[ChunkKey, np.ndarray | None] = {}
        shared: set[ChunkKey] = set()
        for k, e, a in zip(keys, entries, arrays, strict=True):
            if a is not None:
                mapped[k] = a[0]
                if len(a) > 2 and a[2]:
                    shared.add(k)
                out.append(a[1])
            elif e is not None and client.shared_tiers():
                mapped[k] = None
                out.append(e.header)
            else:
                out.append(None)
        with self._lock:
            for k, a in mapped.items():
                self._mapped[k] = a
                self._mapped.move_to_end(k)
                (self._shared.add if k in shared else self._shared.discard)(k)
            held = sum(a.nbytes for a in self._mapped.values() if a is not None)
            for k in list(self._mapped):
                if held <= self.client.max_mapped_bytes:
                    break
                if k not in mapped:
                    a = self._mapped.pop(k)
                    self._shared.discard(k)
                    held -= 0 if a is None else a.nbytes
        return out

    def forget(self) -> None:
        """Drop every mapped object kept here (the next request maps its own anew)."""
        with self._lock:
            self._mapped.clear()
            self._shared.clear()

    def use_device(self, device) -> None:
        """A CUDA staging source reads this: a client that can (the agent's) registers the
        memory its objects arrive in with CUDA."""
        hook = getattr(self.client, "use_cuda", None)
        if hook is not None:
            hook()

    def views_device_readable(self, key: ChunkKey) -> bool:
        """Whether ``key``'s views (from :meth:`layer_views`) lie in memory the copy engine
        reads directly (the agent's registered arena): then they go to the GPU unstaged."""
        check = getattr(self.client, "device_readable", None)
        with self._lock:
            arr = self._mapped.get(key)
            shared = key in self._shared
        return check is not None and arr is not None and not shared and check(arr)

    def layer_views(self, key: ChunkKey, header: ChunkHeader) -> list[np.ndarray] | None:
        """Zero-copy views of a mapped object's raw layers (checked at the shard); None for an
        object with lz4 layers or one read from a shared tier (``layer_into`` reads those)."""
        with self._lock:
            arr = self._mapped.get(key)
            shared = key in self._shared
        if arr is None or shared or any(e.codec != CODEC_RAW for e in header.layers):
            return None
        views = [arr[e.offset:e.offset + e.stored_len] for e in header.layers]
        if any(v.nbytes != e.stored_len for v, e in zip(views, header.layers, strict=True)):
            return None
        return views

    def layer_into(self, key: ChunkKey, header: ChunkHeader, layer_idx: int, out: np.ndarray) -> bool:
        with self._lock:
            present = key in self._mapped
            arr = self._mapped.get(key)
            shared = key in self._shared
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
                    if shared:  # read from Redis or S3 by the agent: its checksum, or tag
                        check_payload(header, layer_idx, payload)
                    np.copyto(out, payload)  # no GIL while copying; checked at the shard
                else:  # host memory: checked as it entered; a shared tier's: tag too
                    decode_layer(header, layer_idx, payload, memoryview(out), authenticate=shared)
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
