"""Host→device layer pipeline: a KV source that streams a request's chunk layers onto the GPU.

The blend engine asks for every cached layer of a request at once (``fetch_layers``) and
consumes them in order while it computes (CacheBlend, Yao et al., EuroSys 2025, §5: loading
hides under recompute). This module moves them, in the process that owns the GPU::

    host bytes (a client's mapped objects, a memory or disk tier)          this process
      |  io threads (tiers.gather): one memcpy / pread per chunk (GIL released), lz4 decoded where stored so
      v
    pinned slot (ring of ``read_ahead + 1``, allocated once, grown only for a larger request)
      |  ONE host-to-device copy per layer (all chunks coalesced) on a side CUDA stream,
      |  then one event per layer; the future resolves once the copy is *queued*
      v
    device buffer -> per-chunk [2, T_i, H, D] views, in a blend.protocols.LayerBatch whose
                     ``ready`` event the engine's stream waits on (no host sync in its loop)

* One staging thread per source runs a request's layers in order; slot ``i`` is refilled
  only after the copy that read it completed (the staging thread waits on that event, the
  compute thread never does), and at most ``max_ahead`` layers are delivered beyond the one
  the consumer last took (unless another request waits).
* Hot chunks skip the slot: from its second use a chunk is copied, in the background, into
  page-locked memory (:mod:`tiers.pinned`) and its layers then go to the device straight
  from there (one copy per chunk and layer, no host memcpy).
* Pinning happens here, in the copying process: pinned memory of another process (a Ray
  shard) would not make this process's copies asynchronous.
* The device buffer is allocated on the copy stream and ``record_stream``-ed on the stream
  that was current where ``fetch_layers`` was called (the consumer's), so the caching
  allocator never hands it out while the consumer may still read it.
* Where bytes come from is a :class:`tiers.host_layers.HostLayers` (``headers`` +
  ``layer_into``, optionally ``layer_views``): the cache clients implement it;
  :class:`tiers.host_layers.TierLayers` adapts any byte tier. Checksums are the reader's
  business, checked where they protect something: host memory's objects were checked when
  they entered it, so they are copied unchecked; disk and lz4 layers are checked as they
  are read (on io threads, off the engine's thread either way).

Failure behaviour: like every tier read, a missing, truncated or corrupted chunk layer is a
miss: ``None`` in that chunk's slot (counted in :attr:`StagedSource.read_counters`), never an
exception. Only caller mistakes raise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tiers.codec import TORCH_DTYPES, LayerBatch
from tiers.direct_copy import copy_group, group_size
from tiers.gather import LayerGather
from tiers.host_layers import TierLayers
from tiers.keys import ChunkKey
from tiers.pinned import PinnedChunks
from tiers.reader import ReadCounters

log = logging.getLogger(__name__)

_ALIGN = 1 << 20          # pinned slots grow in whole MiB
_MAX_TIMINGS = 4096        # copy timings kept for transfer_stats


@dataclass(frozen=True)
class StagedChunk:
    """What :meth:`StagedSource.lookup` learns (the fields of ``blend.protocols.ChunkMeta``;
    ``tiers`` does not import ``blend``)."""

    key: ChunkKey
    num_tokens: int
    positions: tuple[int, ...]
    tier: str


@dataclass(frozen=True)
class TransferStats:
    """Since the last reset: host→device copies (bytes, device time from CUDA events) and the
    fills of the pinned slots before them (host seconds and bytes)."""

    num_copies: int
    num_bytes: int
    copy_s: float
    fill_s: float = 0.0
    fill_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    @property
    def fill_gbps(self) -> float:
        return self.fill_bytes / self.fill_s / 1e9 if self.fill_s > 0 else 0.0


class _Taken(Future):
    """A layer's future that notes when its consumer first asks for the result (the staging
    thread keeps at most ``max_ahead`` layers on the device ahead of the one being used)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = threading.Event()

    def result(self, timeout: float | None = None):
        self.taken.set()
        return super().result(timeout)


@dataclass
class _Request:
    keys: tuple[ChunkKey, ...]
    layers: list[int]
    futures: list[_Taken]
    stream: object = None  # the caller's current CUDA stream: where the layers are used

    def cancelled(self) -> bool:
        return all(f.cancelled() for f in self.futures)


class StagedSource:
    """A ``blend.protocols.KVSource`` over :class:`tiers.host_layers.HostLayers`, delivering
    layers on ``device``.

    Args:
        layers: where the bytes come from (a cache client's ``host_layers()``, or
            :class:`TierLayers` over a tier; a bare tier is wrapped in one).
        device: where layers are delivered (``cuda:0``; ``cpu`` in tests: plain tensors).
        read_ahead: layers staged in pinned memory ahead of the oldest copy in flight.
        max_ahead: layers delivered (on the device) ahead of the one the consumer last took:
            bounds the device memory a request holds; the staging thread waits at most
            ``take_timeout_s`` for the consumer, then the rest of the request are misses.
        num_io_threads: threads copying the chunks of one layer in parallel.
        pinned_bytes: hot chunks kept in page-locked memory (:mod:`tiers.pinned`): a chunk
            staged from ``layer_views`` is copied there in the background, and later requests
            copy its layers to the device with no host memcpy. 0: none.

    Lifecycle: ``fetch_layers(keys, layers)`` once per request; ``close()`` stops the threads.
    ``lookup`` answers from the headers (the vLLM worker looks up through its client).
    """

    def __init__(self, layers, device: str | torch.device = "cpu", *, read_ahead: int = 3,
                 max_ahead: int = 6, num_io_threads: int = 8, take_timeout_s: float = 30.0,
                 pinned_bytes: int = 8 << 30) -> None:
        if read_ahead < 0 or num_io_threads < 1:
            raise ValueError(f"read_ahead={read_ahead} must be >= 0 and num_io_threads={num_io_threads} >= 1")
        self.layers = layers if hasattr(layers, "layer_into") else TierLayers(layers)
        self.name = self.layers.name
        self.device = torch.device(device)
        self.read_ahead = read_ahead
        self.max_ahead = max(1, max_ahead)
        self.take_timeout_s = take_timeout_s
        self._fill_s, self._fill_bytes = 0.0, 0
        self._queued = 0  # requests submitted and not started: the look-ahead bound yields to them
        self._waiting: list[_Request] = []  # those requests (close() resolves them)
        self.read_counters = getattr(self.layers, "counters", ReadCounters())
        self._cuda = self.device.type == "cuda"
        self._slots: list[torch.Tensor | None] = [None] * (read_ahead + 1)
        self._slot_done: list[object | None] = [None] * (read_ahead + 1)
        self._timings: deque = deque(maxlen=_MAX_TIMINGS)
        self._lock = threading.Lock()
        self.gather = LayerGather(self.layers, num_io_threads, self._cuda)
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="kvblend-stage")
        self.pinned = PinnedChunks(pinned_bytes, register=self._cuda,
                                   device=self.device if self._cuda else None)
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
            use_device = getattr(self.layers, "use_device", None)
            if use_device is not None:  # e.g. the agent client registers its arena with CUDA
                use_device(self.device)

    # ------------------------------------------------------------------ KVSource
    def lookup(self, keys: Sequence[ChunkKey]) -> list:
        """``blend.protocols.ChunkMeta``-shaped answers (key, num_tokens, positions, tier)."""
        return [None if h is None else StagedChunk(k, h.num_tokens, tuple(h.position_list()), self.name)
                for k, h in zip(keys, self.layers.headers(list(keys)), strict=True)]

    def fetch_layers(self, keys: Sequence[ChunkKey], layer_idxs: Sequence[int]) -> list[Future]:
        """A future per layer of ``layer_idxs``: each chunk's ``[2, T_i, H, D]`` on ``device``
        (None where it could not be read) in a ``LayerBatch`` whose ``ready`` event (CUDA)
        the consumer's stream waits on. Layers are staged in the order given.

        Raises:
            ValueError: a negative layer index.
        """
        layer_idxs = list(layer_idxs)
        if any(i < 0 for i in layer_idxs):
            raise ValueError(f"layer_idxs {layer_idxs} must be >= 0")
        req = _Request(tuple(keys), layer_idxs, [_Taken() for _ in layer_idxs],
                       torch.cuda.current_stream(self.device) if self._cuda else None)
        if req.futures:
            with self._lock:
                self._queued += 1
                self._waiting.append(req)
            self._stager.submit(self._run, req)
        return req.futures

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future:
        """One layer (see :meth:`fetch_layers`); for callers outside the engine."""
        return self.fetch_layers(keys, [layer_idx])[0]

    # ------------------------------------------------------------------ stats
    def transfer_stats(self) -> TransferStats:
        """Copies since the last :meth:`reset_stats` (waits for their end events)."""
        with self._lock:
            timings = list(self._timings)
        seconds = 0.0
        for start, end, _n in timings:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        with self._lock:
            fill_s, fill_bytes = self._fill_s, self._fill_bytes
        return TransferStats(len(timings), sum(n for _s, _e, n in timings), seconds, fill_s, fill_bytes)

    def reset_stats(self) -> None:
        with self._lock:
            self._timings.clear()
            self._fill_s, self._fill_bytes = 0.0, 0

    def close(self) -> None:
        """Stop the threads; requests not started yet resolve as misses (never left pending)."""
        with self._lock:
            waiting = list(self._waiting)
        for req in waiting:
            for fut in req.futures:
                if not fut.done() and fut.set_running_or_notify_cancel():
                    fut.set_result(LayerBatch([None] * len(req.keys)))
        self._stager.shutdown(wait=True, cancel_futures=True)
        self.gather.close()
        self.pinned.close()

    # ------------------------------------------------------------------ internals
    def _run(self, req: _Request) -> None:
        """The staging thread: headers once, then every layer in order; from pinned memory
        when every hit chunk is pinned, else through the slots (and chunks with checked
        views are queued for pinning, for the next request). Every future is resolved when
        it returns, whatever failed (a fault is a miss)."""
        with self._lock:
            self._queued -= 1
            self._waiting = [r for r in self._waiting if r is not req]
        if all(f.done() for f in req.futures):  # resolved by close()
            return
        pinned: list = []
        readable = None
        start = time.perf_counter()
        try:
            headers = [None] * len(req.keys)
            if not req.cancelled():
                got = self.layers.headers(list(req.keys))
                if len(got) == len(req.keys):
                    headers = list(got)
            views = self.gather.views(req.keys, headers)
            sizes = [0 if h is None else h.layer_nbytes for h in headers]
            offsets = np.cumsum([0] + sizes[:-1]).tolist() if sizes else []
            total = sum(sizes)
            pinned = self.pinned.acquire(req.keys)
            readable = self.gather.device_readable(req.keys, headers, views)
            if readable is not None:  # views the copy engine reads: no pinned copy either
                self._run_direct(req, headers, readable)
                return
            if views is not None:
                for key, h, p, v in zip(req.keys, headers, pinned, views, strict=True):
                    if h is not None and p is None:
                        self.pinned.pin_later(key, v)
            hits = [(p, h) for p, h in zip(pinned, headers, strict=True) if h is not None]
            direct = bool(hits) and all(p is not None and len(p.layers) == h.num_layers
                                        and all(x.nbytes == h.layer_nbytes for x in p.layers)
                                        for p, h in hits)
            if direct:
                self._run_direct(req, headers, pinned)
            else:  # the headers and views read the objects (a tier's whole read, for most)
                self._run_layers(req, headers, views, offsets, total, time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - a broken reader is a miss for the request
            log.warning("%s: staging a request failed (%s: %s)", self.name, type(e).__name__, e)
        finally:
            if readable is not None:  # the views may go back to their owner once copied
                last = [r.last_copy for r in readable if r is not None and r.last_copy is not None]
                if last:
                    last[-1].synchronize()
            self.pinned.release_all(pinned)
            for fut in req.futures:  # nothing left pending: the consumer never hangs
                if fut.done():
                    continue
                if fut.running() or fut.set_running_or_notify_cancel():
                    fut.set_result(LayerBatch([None] * len(req.keys)))

    def _run_direct(self, req: _Request, headers, entries) -> None:
        """Every layer of ``req`` in order straight from ``entries`` (pinned chunks, or views
        the copy engine reads): :func:`tiers.direct_copy.group_size` adjacent layers a copy."""
        group, layers, n = group_size(headers, self.max_ahead), req.layers, 0
        none = LayerBatch([None] * len(req.keys))
        while n < len(layers):
            size = 1
            while size < group and n + size < len(layers) and layers[n + size] == layers[n + size - 1] + 1:
                size += 1
            last = n + size - 1
            if last >= self.max_ahead and not self._wait_taken(req, last - self.max_ahead):
                for rest in req.futures[n:]:
                    if rest.set_running_or_notify_cancel():
                        rest.set_result(none)
                return
            futs = req.futures[n:n + size]
            claimed = [f.set_running_or_notify_cancel() for f in futs]
            if any(claimed):
                try:
                    batches, timing = copy_group(entries, headers, layers[n:n + size], self.device,
                                                 self._copy_stream if self._cuda else None, req.stream)
                    if timing is not None:
                        with self._lock:
                            self._timings.append(timing)
                except Exception as e:  # noqa: BLE001 - never leave a future unresolved
                    log.warning("%s: copying layers %s failed (%s: %s)", self.name, layers[n:n + size],
                                type(e).__name__, e)
                    batches = [none] * size
                for fut, ok, batch in zip(futs, claimed, batches, strict=True):
                    if ok:
                        fut.set_result(batch)
            n += size

    def _run_layers(self, req: _Request, headers, views, offsets, total: int, busy: float = 0.0) -> None:
        """Every layer of ``req`` in order, each through a pinned slot. Each delivered
        layer carries ``busy_s`` (:class:`tiers.codec.LayerBatch`): ``busy`` (the request's
        headers and views: where most tiers read their objects) plus the seconds spent so far
        in :meth:`_stage` (a free slot, the fill, the copy queued), the waits for the consumer
        left out: what the cost estimates take as this request's own transfer time. The last
        ``read_ahead + 1`` copies are queued, not waited for: it runs short by their time.
        Layers copied straight from pinned or device-readable memory carry none."""
        for n, (layer_idx, fut) in enumerate(zip(req.layers, req.futures, strict=True)):
            if n >= self.max_ahead and not self._wait_taken(req, n - self.max_ahead):
                for rest in req.futures[n:]:
                    if rest.set_running_or_notify_cancel():
                        rest.set_result([None] * len(req.keys))
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                t0 = time.perf_counter()
                batch = self._stage(req, headers, views, offsets, total, layer_idx, n)
                busy += time.perf_counter() - t0
                batch.busy_s = busy
                fut.set_result(batch)
            except Exception as e:  # noqa: BLE001 - never leave a future unresolved
                log.warning("%s: staging layer %d failed (%s: %s)", self.name, layer_idx,
                            type(e).__name__, e)
                fut.set_result([None] * len(req.keys))

    def _wait_taken(self, req: _Request, n: int) -> bool:
        """Wait until layer ``n`` of ``req`` was taken, or the consumer cancelled it or the
        layer to stage next, or another request is waiting for this thread (a consumer that
        pauses between layers, an async blend, must not hold up the next request: the bound
        then is the request's own layers); False after ``take_timeout_s`` (a consumer that
        stopped asking without cancelling)."""
        fut, upcoming = req.futures[n], req.futures[n + self.max_ahead]
        waited = 0.0
        while True:
            if fut.taken.is_set() or fut.cancelled() or upcoming.cancelled():
                return True
            with self._lock:
                if self._queued > 0:
                    return True
            if waited >= self.take_timeout_s:
                log.warning("%s: layer %d was not taken in %.0f s: the rest of the request are misses",
                            self.name, req.layers[n], self.take_timeout_s)
                return False
            fut.taken.wait(0.02)
            waited += 0.02

    def _slot(self, n: int, nbytes: int) -> torch.Tensor:
        """Ring slot ``n % len``, at least ``nbytes``, free (its last copy completed)."""
        i = n % len(self._slots)
        done = self._slot_done[i]
        if done is not None:
            done.synchronize()  # the staging thread waits for the copy; compute never does
        slot = self._slots[i]
        if slot is None or slot.numel() < nbytes:
            size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
            slot = self._slots[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)
        return slot

    def _stage(self, req: _Request, headers, views, offsets, total: int, layer_idx: int, n: int) -> LayerBatch:
        """Layer ``layer_idx`` of every chunk: filled into ring slot ``n``, then one copy.
        With ``views`` the fill is one numpy copy per chunk on the io threads (no other
        per-chunk Python); otherwise ``layer_into`` on the io threads."""
        keys = req.keys
        out = LayerBatch([None] * len(keys))
        if total == 0:
            return out
        slot = self._slot(n, total)
        t0 = time.perf_counter()
        raw = slot.numpy()
        if views is not None:
            ok = [h is not None and 0 <= layer_idx < h.num_layers for h in headers]
            self.gather.copy_views([(raw[offsets[i]:offsets[i] + headers[i].layer_nbytes], views[i][layer_idx])
                              for i, good in enumerate(ok) if good], total)
        else:
            ok = self.gather.fill(keys, headers, offsets, layer_idx, raw[:total])
        with self._lock:
            self._fill_s += time.perf_counter() - t0
            self._fill_bytes += total
        if not any(ok):
            return out
        host = slot[:total]
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._copy_stream):
                dev = torch.empty(total, dtype=torch.uint8, device=self.device)
                start.record()
                dev.copy_(host, non_blocking=True)
                end.record()
            dev.record_stream(req.stream)  # freed only after the consumer's uses
            self._slot_done[n % len(self._slots)] = end
            with self._lock:
                self._timings.append((start, end, total))
            out.ready = end
        else:
            dev = host.clone()
        for i, (h, off) in enumerate(zip(headers, offsets, strict=True)):
            if ok[i]:
                out[i] = dev[off:off + h.layer_nbytes].view(TORCH_DTYPES[h.dtype]).view(h.layer_shape)
        return out
