"""Host→GPU layer pipeline: a KV source that streams chunk layers from any tier onto the GPU.

The blend engine asks for layer ``l+1`` (and ``l+2``) of the hit chunks while it computes
layer ``l`` (CacheBlend, Yao et al., EuroSys 2025, §5: loading hides under recompute). This
module does the moving, in the process that owns the GPU::

    byte tier (host memory / disk file)                       this process
      |  worker threads: pread / memcpy per chunk, XXH3 check   (GIL released)
      v
    pinned staging slot  [sum of the chunks' layer bytes]       one per layer in flight
      |  ONE cudaMemcpyAsync per layer (all chunks coalesced: >= 1 MiB), on a side CUDA stream,
      |  bracketed by CUDA events; the future resolves when the end event has completed
      v
    device buffer -> per-chunk [2, T, H, D] views handed to the engine

* Reads run ahead: asking for layer ``l`` schedules the reads of ``l .. l+read_ahead`` into
  pinned slots, so disk reads feed the staging buffers ahead of the copies.
* Pinning happens here, in the copying process: pinned memory of another process (a Ray
  shard) would not make this process's copies asynchronous.
* The device buffer is allocated on the side stream and ``record_stream``-ed on the compute
  stream, so the caching allocator never hands it out while compute may still read it; no
  full-device synchronisation anywhere.
* A :class:`tiers.gpu.GpuTier` is served as is (views of the pool, no copy).

Failure behaviour: like every tier read, a missing, truncated or corrupted chunk layer is a
miss: the future resolves to ``None`` in that chunk's slot (counted in
:attr:`StagedSource.read_counters`), never an exception. Only caller mistakes raise.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from tiers.codec import TORCH_DTYPES
from tiers.format import CODEC_RAW, ChunkHeader, FormatError, decode_layer
from tiers.gpu import GpuTier
from tiers.keys import ChunkKey
from tiers.reader import ReadCounters, read_header, read_layers

log = logging.getLogger(__name__)

_ALIGN = 1 << 20  # staging slots grow in whole MiB


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
    """Host→GPU copies since the last reset: bytes, device time of the copies (CUDA events)."""

    num_copies: int
    num_bytes: int
    copy_s: float

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.copy_s / 1e9 if self.copy_s > 0 else 0.0


class PinnedPool:
    """Reusable page-locked host buffers (uint8), grown on demand, never shrunk.

    ``acquire(nbytes)`` returns a free buffer of at least ``nbytes`` (allocating one when
    none fits); ``release`` returns it. Pinned only when CUDA is available.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.num_allocated = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            # by position, never ``list.remove``: ``==`` on tensors compares elements
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            if len(self._free) > 4:  # drop the smallest rather than hoard
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            self.num_allocated += 1
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


@dataclass
class _Staged:
    slot: torch.Tensor | None          # pinned bytes of the layer, chunks back to back
    offsets: list[int]                 # byte offset of each chunk in the slot
    headers: list[ChunkHeader | None]  # None: that chunk missed
    num_bytes: int


class StagedSource:
    """A ``blend.protocols.KVSource`` over one tier, delivering layers on ``device``.

    Args:
        tier: a byte tier (:class:`tiers.host.HostTier`, :class:`tiers.disk.DiskTier`, any
            :class:`tiers.tier.Tier`) or a :class:`tiers.gpu.GpuTier`.
        device: where layers are delivered (``cuda:0``; ``cpu`` in tests: plain copies).
        read_ahead: layers read into pinned memory ahead of the one asked for.
        num_io_threads: threads reading chunks of one layer in parallel.
        verify: check XXH3 of every layer read (always done for tiers with
            ``get_ranges_into``, i.e. disk, by :func:`tiers.reader.read_layers`).

    Lifecycle: ``lookup(keys)`` once per request (reads and caches the headers), then
    ``fetch_layer(keys, l)`` for ``l`` ascending. ``close()`` stops the threads.
    """

    def __init__(self, tier, device: str | torch.device = "cpu", *, read_ahead: int = 2,
                 num_io_threads: int = 8, verify: bool = True) -> None:
        if read_ahead < 0 or num_io_threads < 1:
            raise ValueError(f"read_ahead={read_ahead} must be >= 0 and num_io_threads={num_io_threads} >= 1")
        self.tier = tier
        self.name = getattr(tier, "name", type(tier).__name__)
        self.device = torch.device(device)
        self.read_ahead = read_ahead
        self.verify = verify
        self.read_counters = ReadCounters()
        self._gpu_tier = isinstance(tier, GpuTier)
        self._cuda = self.device.type == "cuda"
        self._pool = PinnedPool(pin=self._cuda)
        self._headers: dict[ChunkKey, ChunkHeader] = {}
        self._reads: dict[tuple[tuple[ChunkKey, ...], int], Future] = {}
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kvblend-stage-io")
        self._readers = ThreadPoolExecutor(read_ahead + 1, thread_name_prefix="kvblend-stage-read")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvblend-stage-copy")
        self._events: list[tuple[object, object, int]] = []
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
            self._compute_stream = torch.cuda.current_stream(self.device)

    # ------------------------------------------------------------------ KVSource
    def lookup(self, keys: Sequence[ChunkKey]) -> list[StagedChunk | None]:
        """Which keys the tier holds, with their token counts and stored positions."""
        out: list[StagedChunk | None] = []
        for key in keys:
            if self._gpu_tier:
                kv = self.tier.get(key)
                if kv is None:
                    out.append(None)
                    continue
                pos = self.tier.positions(key) or tuple(range(kv.shape[2]))
                out.append(StagedChunk(key, int(kv.shape[2]), tuple(pos), self.name))
                continue
            header = self._header(key, refresh=True)
            out.append(None if header is None else
                       StagedChunk(key, header.num_tokens, tuple(header.position_list()), self.name))
        return out

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future:
        """Layer ``layer_idx`` of each chunk as ``[2, T_i, H, D]`` on ``device`` (None for a
        chunk that could not be read). The future resolves once the bytes are on the device
        (the copy's end event completed), so any stream may use them."""
        if layer_idx < 0:
            raise ValueError(f"layer_idx={layer_idx} must be >= 0")
        keys = tuple(keys)
        if self._gpu_tier:
            fut: Future = Future()
            fut.set_result([self.tier.get_layer(k, layer_idx) for k in keys])
            return fut
        self._schedule(keys, layer_idx)
        return self._copier.submit(self._deliver, keys, layer_idx)

    # ------------------------------------------------------------------ stats
    def transfer_stats(self) -> TransferStats:
        """Copies since the last :meth:`reset_stats` (waits for their end events)."""
        with self._lock:
            events = list(self._events)
        seconds = 0.0
        for start, end, _n in events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        return TransferStats(len(events), sum(n for _s, _e, n in events), seconds)

    def reset_stats(self) -> None:
        with self._lock:
            self._events.clear()

    def close(self) -> None:
        for pool in (self._copier, self._readers, self._io):
            pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _header(self, key: ChunkKey, refresh: bool = False) -> ChunkHeader | None:
        """The validated header of ``key`` (cached after the first read; ``lookup`` refreshes)."""
        header = None if refresh else self._headers.get(key)
        if header is None:
            header = read_header(self.tier, key, self.read_counters)
            if header is not None and header.dtype in TORCH_DTYPES:
                self._headers[key] = header
            else:
                self._headers.pop(key, None)
                header = None
        return header

    def _schedule(self, keys: tuple[ChunkKey, ...], layer_idx: int) -> None:
        """Start reads of ``layer_idx .. layer_idx + read_ahead``; drop stale ones."""
        with self._lock:
            for k in [k for k in self._reads if k[0] != keys or k[1] < layer_idx]:
                self._reads.pop(k).add_done_callback(self._release_unused)
            headers = [self._headers.get(k) for k in keys]
            num_layers = min((h.num_layers for h in headers if h is not None), default=layer_idx + 1)
            for idx in range(layer_idx, min(layer_idx + self.read_ahead + 1, max(num_layers, layer_idx + 1))):
                if (keys, idx) not in self._reads:
                    self._reads[(keys, idx)] = self._readers.submit(self._read, keys, idx)

    def _release_unused(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None and fut.result().slot is not None:
            self._pool.release(fut.result().slot)

    def _read(self, keys: tuple[ChunkKey, ...], layer_idx: int) -> _Staged:
        headers = [self._header(k) for k in keys]
        offsets, total = [], 0
        for h in headers:
            offsets.append(total)
            total += 0 if h is None else h.layer_nbytes
        if total == 0:
            return _Staged(None, offsets, headers, 0)
        slot = self._pool.acquire(total)
        if getattr(self.tier, "get_ranges_into", None) is None:
            ok = self._read_memory(keys, headers, layer_idx, slot, offsets)
        else:
            raw = slot.numpy()
            jobs = [self._io.submit(self._read_chunk, k, h, layer_idx, raw[o:o + h.layer_nbytes])
                    if h is not None else None for k, h, o in zip(keys, headers, offsets, strict=False)]
            ok = [j is not None and j.result() for j in jobs]
        for k, h, good in zip(keys, headers, ok, strict=False):
            if h is not None and not good:  # a stale header (object re-encoded) must not stick
                self._headers.pop(k, None)
        return _Staged(slot, offsets, [h if good else None for h, good in zip(headers, ok, strict=False)], total)

    def _read_memory(self, keys, headers, layer_idx: int, slot: torch.Tensor, offsets: list[int]) -> list[bool]:
        """A memory tier's layer: zero-copy views of the stored payloads, copied into the
        pinned slot by ``Tensor.copy_`` (multi-threaded, GIL released), checksums verified on
        the io threads meanwhile (the stored bytes are immutable, so checking them checks
        what was copied)."""
        ok = [False] * len(keys)
        counted = 0  # lz4 layers count their own hits in _read_chunk
        checks = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer of a read-only view: we only read it
            for i, (key, header, off) in enumerate(zip(keys, headers, offsets, strict=False)):
                if header is None:
                    continue
                if not 0 <= layer_idx < header.num_layers:
                    self.read_counters.add("corrupt")
                    continue
                entry = header.layers[layer_idx]
                if entry.codec != CODEC_RAW:  # lz4: decode (rare for KV, kept correct)
                    ok[i] = self._read_chunk(key, header, layer_idx, slot.numpy()[off:off + header.layer_nbytes])
                    counted += ok[i]
                    continue
                try:
                    got = self.tier.get_ranges(key, [(entry.offset, entry.stored_len)])
                except Exception as e:  # noqa: BLE001 - a broken tier is a miss
                    log.warning("%s: read of %s failed (%s: %s)", self.name, key, type(e).__name__, e)
                    got = None
                if got is None or len(got[0]) != entry.stored_len:
                    self.read_counters.add("misses" if got is None else "corrupt")
                    continue
                slot[off:off + entry.stored_len].copy_(torch.frombuffer(got[0], dtype=torch.uint8))
                ok[i] = True
                if self.verify:
                    checks.append((i, self._io.submit(xxhash.xxh3_64_intdigest, got[0]), entry.checksum))
        for i, fut, want in checks:
            if fut.result() != want:
                log.debug("%s: checksum mismatch in layer %d of %s", self.name, layer_idx, keys[i])
                self.read_counters.add("corrupt")
                ok[i] = False
        self.read_counters.add("hits", sum(ok) - counted)
        return ok

    def _read_chunk(self, key: ChunkKey, header: ChunkHeader, layer_idx: int, out: np.ndarray) -> bool:
        """One chunk's layer into ``out`` (pinned); False on a miss or a corrupt layer."""
        try:
            if not 0 <= layer_idx < header.num_layers:
                self.read_counters.add("corrupt")
                return False
            if getattr(self.tier, "get_ranges_into", None) is not None:  # disk: preadv into pinned
                return read_layers(self.tier, key, [layer_idx], [out], header=header,
                                   counters=self.read_counters) is not None
            entry = header.layers[layer_idx]
            got = self.tier.get_ranges(key, [(entry.offset, entry.stored_len)])
            if got is None:
                self.read_counters.add("misses")
                return False
            payload = got[0]
            if entry.codec != CODEC_RAW:
                decode_layer(header, layer_idx, payload, memoryview(out))
            else:
                if len(payload) != entry.stored_len:
                    raise FormatError(f"layer {layer_idx}: {len(payload)} bytes, expected {entry.stored_len}")
                # numpy copies without the GIL: the chunks of a layer are copied in parallel
                np.copyto(out, np.frombuffer(payload, dtype=np.uint8))
                if self.verify and xxhash.xxh3_64_intdigest(payload) != entry.checksum:
                    raise FormatError(f"layer {layer_idx}: checksum mismatch")
            self.read_counters.add("hits")
            return True
        except FormatError as e:
            log.debug("%s: rejected layer %d of %s: %s", self.name, layer_idx, key, e)
            self.read_counters.add("corrupt")
            return False
        except Exception as e:  # noqa: BLE001 - a broken tier is a miss, never a failed request
            log.warning("%s: read of layer %d of %s failed (%s: %s)", self.name, layer_idx, key,
                        type(e).__name__, e)
            self.read_counters.add("misses")
            return False

    def _deliver(self, keys: tuple[ChunkKey, ...], layer_idx: int) -> list[torch.Tensor | None]:
        with self._lock:
            fut = self._reads.pop((keys, layer_idx), None)
        if fut is None:  # dropped as stale by a newer request: read it again
            fut = self._readers.submit(self._read, keys, layer_idx)
        staged = fut.result()
        if staged.slot is None:
            return [None] * len(keys)
        host = staged.slot[:staged.num_bytes]
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._copy_stream):
                dev = torch.empty(staged.num_bytes, dtype=torch.uint8, device=self.device)
                start.record()
                dev.copy_(host, non_blocking=True)
                end.record()
            dev.record_stream(self._compute_stream)  # freed only after compute's uses
            end.synchronize()  # this thread waits; compute streams never do
            with self._lock:
                self._events.append((start, end, staged.num_bytes))
        else:
            dev = host.to(self.device, copy=True)
        self._pool.release(staged.slot)
        out: list[torch.Tensor | None] = []
        for h, off in zip(staged.headers, staged.offsets, strict=False):
            if h is None:
                out.append(None)
                continue
            out.append(dev[off:off + h.layer_nbytes].view(TORCH_DTYPES[h.dtype]).view(h.layer_shape))
        return out
