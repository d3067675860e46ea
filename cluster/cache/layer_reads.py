"""The read half of :class:`cluster.cache.client.CacheClient`: a request's chunk layers, from
the objects the client holds or the shared Redis/S3 tiers (:class:`LayerReads`, its base class).

What a read does, whatever the transport::

    fetch_layers(keys, layer_idxs)   one of the client's threads reads the layers in order
      |                              (blend.protocols.fetch_in_order), or the caller's thread
      v                              over a transport that is not ``threaded``
    map_for_read(keys)               unknown keys looked up; objects not held yet asked of the
      |                              transport in ONE ``objects`` call, each checked against
      v                              its looked-up header, then held (LRU, the transport's bytes)
    per key and layer                a slice of the held object (waiting, bounded, for the round
                                     of a pipelined arena copy that holds it), checked unless the
                                     shard checked it, decoded, copied once to ``device``; or one
                                     layer read directly from the first shared tier with a copy

One deadline per read (issue 20): ``max(call_timeout_s, load_timeout_s)``; past it no direct
read is started and what has not arrived is a miss (``timeouts``). A fault is a miss and a
counter, never an exception in a future. The CUDA worker's staging reads through
:meth:`LayerReads.host_layers` instead (:class:`cluster.cache.host_layers.ClientHostLayers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from blend.protocols import fetch_in_order
from cluster.cache.headers import HeaderEntry, arrived, object_bound, own_header
from cluster.cache.host_layers import ClientHostLayers
from cluster.cache.ops import DeferredRead, ObjectsRequest
from tiers.codec import layer_tensor, object_layer
from tiers.format import FormatError
from tiers.keys import ChunkKey

log = logging.getLogger("kvblend.client")


class LayerReads:
    """Layer reads of a cache client. Uses what :class:`cluster.cache.client.CacheClient` holds:
    ``_lock``, ``_meta`` (the header cache), ``objects`` (held objects), ``_pool`` (fetch
    threads), ``device``, ``fetch_timeout_s``, ``transport`` / ``transports``, ``count``,
    ``lookup`` and ``shared_tiers`` / ``_shared_stack`` (the shared tiers read directly)."""

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future[list[torch.Tensor | None]]:
        """One layer of each chunk (see :meth:`fetch_layers`).

        Raises:
            ValueError: negative ``layer_idx`` (immediately, not through the future).
        """
        if layer_idx < 0:
            raise ValueError(f"layer_idx={layer_idx} must be >= 0")
        if not self.transport.threaded:  # read now, in the caller's thread
            done: Future = Future()
            done.set_result(self._fetch(list(keys), layer_idx))
            return done
        return self.fetch_layers(keys, [layer_idx])[0]

    def fetch_layers(self, keys: Sequence[ChunkKey],
                     layer_idxs: Sequence[int]) -> list[Future[list[torch.Tensor | None]]]:
        """Every layer of ``keys``, in order (:class:`blend.protocols.KVSource`): one of the client's
        threads reads them (:func:`blend.protocols.fetch_in_order`), or each future when asked.

        Shapes:
            Each result is ``[2, T_i, H, D]`` (K then V) in the stored dtype on ``device``;
            None where the chunk cannot be read (absent, its store died and no shared tier
            holds it, corrupted, ``layer_idx`` past its last layer).

        Raises:
            ValueError: a negative layer index (at the call).
        """
        keys = list(keys)
        if self.transport.threaded:
            return fetch_in_order(self._pool.submit, self._fetch, keys, layer_idxs)
        if any(i < 0 for i in layer_idxs):
            raise ValueError(f"layer_idxs {list(layer_idxs)} must be >= 0")
        return [DeferredRead(lambda i=i: self.fetch_layer(keys, i).result()) for i in layer_idxs]

    def _fetch(self, keys: list[ChunkKey], layer_idx: int) -> list[torch.Tensor | None]:
        try:
            return self._fetch_unsafe(keys, layer_idx)
        except Exception as e:  # noqa: BLE001 - a future must never carry a cache fault
            log.warning("fetch_layer failed, serving misses: %r", e)
            self.count("layer_misses", len(keys))
            return [None] * len(keys)

    def _fetch_unsafe(self, keys: list[ChunkKey], layer_idx: int) -> list[torch.Tensor | None]:
        # one deadline for the whole read (issue 20): past it, no direct read (an io_timeout_s
        # each, serial) is started, and those keys are misses (``timeouts``)
        deadline = time.monotonic() + self.fetch_timeout_s
        entries, held = self.map_for_read(keys)
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, (k, e, h) in enumerate(zip(keys, entries, held, strict=True)):
            if h is not None and layer_idx < h[1].num_layers:
                if arrived(h, h[1].layers[layer_idx], deadline):
                    out[i] = self._decoded(k, h, layer_idx)
                else:
                    self.count("timeouts")  # still on its way at the deadline: a miss
            elif h is None and e is not None and layer_idx < e.header.num_layers and self.shared_tiers():
                if time.monotonic() < deadline:
                    out[i] = self._direct_layer(k, e.header, layer_idx)
                else:
                    self.count("timeouts")
        hits = sum(t is not None for t in out)
        self.count("layer_reads", hits)
        self.count("layer_misses", len(out) - hits)
        return out

    def _decoded(self, key: ChunkKey, held: tuple, layer_idx: int) -> torch.Tensor | None:
        """One layer of a held object, checked (unless it was as it entered host memory),
        decoded and copied out; None (``read_errors``) when it fails."""
        try:
            return object_layer(held[1], layer_idx, held[0], checked=held[2]).to(self.device)
        except (FormatError, ValueError) as err:
            log.debug("layer %d of %s rejected: %s", layer_idx, key, err)
            self.count("read_errors")
            return None

    def _direct_layer(self, key: ChunkKey, header, layer_idx: int) -> torch.Tensor | None:
        """One layer from the first shared tier with a valid copy (the stack checks it), or None."""
        raw = bytearray(header.layer_nbytes)  # raw layer bytes: the same in any encoding
        h = self._shared_stack.read_layers(key, [layer_idx], [raw])
        if h is None:
            return None
        self.count("direct_reads")
        return layer_tensor(raw, h.layer_shape, h.dtype).to(self.device)

    def map_for_read(self, keys: list[ChunkKey]) -> tuple[list[HeaderEntry | None], list[tuple | None]]:
        """Look up unknown keys, then hold the objects of ``keys``: per key its entry (or None)
        and its held ``(object, own header, checked, progress)`` (or None: a miss, or only a
        shared tier holds it; ``progress``: :class:`cluster.cache.arena.Progress` of an object
        still arriving, else None). The objects not held yet come in one ``objects`` call of the transport;
        each is checked against its looked-up header here."""
        keys = list(keys)
        with self._lock:
            unknown = [k for k in keys if k not in self._meta]
        if unknown:
            self.lookup(unknown)
        with self._lock:
            entries = [self._meta.get(k) for k in keys]
            held = [self.objects.get(k) for k in keys]
        need = [i for i, (e, h) in enumerate(zip(entries, held, strict=True)) if e is not None and h is None and e.shard]
        if not need:
            return entries, held
        t = self.transport
        answer = t.objects(ObjectsRequest(tuple(keys[i] for i in need), self.fetch_timeout_s,
                                          bounds=tuple(object_bound(entries[i].header) for i in need)))
        got = {}
        arriving = answer.arriving or (None,) * len(need)
        for i, obj, checked, progress in zip(need, answer.objects, answer.checked, arriving, strict=True):
            if obj is not None:
                try:
                    got[i] = (obj, own_header(keys[i], entries[i].header, obj), checked, progress)
                except FormatError as err:
                    log.debug("object of %s rejected: %s", keys[i], err)
                    self.count("read_errors")
        with self._lock:
            for i, h in got.items():
                held[i] = h
                self.objects[keys[i]] = h
                self.objects.move_to_end(keys[i])
            self.objects.trim(t.keep_bytes)  # oldest first (this call's are in `held` meanwhile)
        return entries, held

    def host_layers(self):
        """Where a CUDA worker's staging (:class:`tiers.staging.StagedSource`) copies this
        client's layers from: the held objects (:class:`~cluster.cache.host_layers.ClientHostLayers`),
        or the tier itself for a client over one local transport."""
        own = getattr(self.transports[0], "host_layers", None) if len(self.transports) == 1 else None
        return own() if own is not None else ClientHostLayers(self)

