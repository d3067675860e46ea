"""Hot chunks in page-locked host memory, so their layers reach the GPU with no host copy.

Staging a layer through a pinned slot (:mod:`tiers.staging`) costs one host memcpy of the
layer before the copy engine can move it: on the H200's host that memcpy ran at 10-14 GB/s
with 8 threads (2026-12-01), against 43-55 GB/s for the host-to-device copy itself, so an
8K-token blend from host memory (1 GiB of KV) waited on its fills. A chunk that is used again
is therefore copied once, in the background, into memory registered with CUDA
(``cudaHostRegister`` of an anonymous ``mmap``: page-aligned, exactly sized, shared with no
other allocation); later requests copy its layers straight from there to the device.

:class:`PinnedChunks` is that store: LRU by bytes (``capacity_bytes``), content-addressed like
every tier (a key's KV never changes), filled by one background thread from a bounded queue
(a full queue drops the request to pin: counted, the chunk is staged as before). An entry in
use by a request is never evicted; one that was read by a copy still in flight is unregistered
only after that copy's event completed. Without CUDA (tests) the memory is plain, not
registered, and everything else is the same.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from tiers.keys import ChunkKey

log = logging.getLogger(__name__)

#: chunks waiting to be pinned at most (a full queue drops the newest request)
MAX_PENDING = 64
#: chunks whose uses are counted toward admission at most (the oldest is forgotten)
MAX_SEEN = 65536


class PinnedChunk:
    """One chunk's raw layers, back to back, in page-locked memory.

    Attributes:
        layers: per layer a uint8 array view ``[layer_nbytes]`` (the layer's ``[2, T, H, D]``).
        nbytes: bytes held.
    """

    __slots__ = ("key", "layers", "nbytes", "users", "last_copy", "_mem", "_ptr", "_registered")

    def __init__(self, key: ChunkKey, views: Sequence[np.ndarray], register: bool) -> None:
        self.key = key
        self.nbytes = int(sum(v.nbytes for v in views))
        self._mem = mmap.mmap(-1, max(self.nbytes, 1))
        buf = np.frombuffer(self._mem, dtype=np.uint8)
        self._ptr = int(buf.ctypes.data)
        self.layers, off = [], 0
        for v in views:
            dst = buf[off:off + v.nbytes]
            np.copyto(dst, v)
            self.layers.append(dst)
            off += v.nbytes
        self._registered = False
        if register:
            import torch

            # cudaHostRegisterPortable (1): pinned for every CUDA context of this process
            err = int(torch.cuda.cudart().cudaHostRegister(self._ptr, self.nbytes, 1))
            if err != 0:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed (cudaError {err})")
            self._registered = True
        self.users = 0          # requests reading it now
        self.last_copy = None   # event of the last device copy that read it

    def release(self) -> None:
        """Unregister (after the last copy that read it completed); memory goes with the object."""
        if self.last_copy is not None:
            self.last_copy.synchronize()
        if self._registered:
            import torch

            err = int(torch.cuda.cudart().cudaHostUnregister(self._ptr))
            if err != 0:
                log.warning("cudaHostUnregister of %d bytes failed (cudaError %d)", self.nbytes, err)
            self._registered = False


class PinnedChunks:
    """LRU of :class:`PinnedChunk` by bytes, filled in the background (module docstring).

    Args:
        capacity_bytes: pinned bytes held at most (0: keep nothing); entries in use may
            exceed it until released.
        register: register the memory with CUDA (the device is CUDA).
        device: the CUDA device whose context the pinning thread uses.
        admit_after: uses of a chunk before it is pinned (2: a chunk seen once is not
            copied; the set of chunks seen is bounded by :data:`MAX_SEEN`).
    """

    def __init__(self, capacity_bytes: int, register: bool, device=None, admit_after: int = 2) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.register = register
        self.device = device
        self.admit_after = max(1, admit_after)
        self._seen: OrderedDict[ChunkKey, int] = OrderedDict()
        self._entries: OrderedDict[ChunkKey, PinnedChunk] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._queued: set[ChunkKey] = set()
        self._queue: queue.Queue = queue.Queue(MAX_PENDING)
        self.counters = dict.fromkeys(("pinned", "evicted", "dropped", "errors"), 0)
        self._thread: threading.Thread | None = None
        self._closed = False

    def acquire(self, keys: Sequence[ChunkKey]) -> list[PinnedChunk | None]:
        """The pinned entry of each key (a use: moved to the LRU's end, held until
        :meth:`release_all`), or None."""
        out = []
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    self._entries.move_to_end(k)
                    e.users += 1
                out.append(e)
        return out

    def release_all(self, entries: Sequence[PinnedChunk | None]) -> None:
        """Undo one :meth:`acquire` of each entry (and evict what in-use entries held over
        capacity)."""
        with self._lock:
            for e in entries:
                if e is not None:
                    e.users -= 1
            victims = self._victims()
        for v in victims:
            _release(v)

    def pin_later(self, key: ChunkKey, views: Sequence[np.ndarray]) -> None:
        """Copy ``views`` (the chunk's checked raw layers) into pinned memory in the background,
        from its ``admit_after``-th use on; a no-op when pinned or queued already or larger
        than the capacity, dropped (counted) when the queue is full."""
        nbytes = sum(v.nbytes for v in views)
        if self.capacity_bytes <= 0 or self._closed or nbytes > self.capacity_bytes:
            return
        with self._lock:
            if key in self._entries or key in self._queued:
                return
            uses = self._seen.pop(key, 0) + 1
            if uses < self.admit_after:
                self._seen[key] = uses
                while len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                return
            self._queued.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvblend-pin", daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((key, list(views)))
        except queue.Full:
            with self._lock:
                self._queued.discard(key)
                self.counters["dropped"] += 1

    def _loop(self) -> None:
        index = getattr(self.device, "index", None)
        if self.register and index is not None:
            try:
                import torch

                torch.cuda.set_device(index)  # register in the worker's device's context
            except Exception as e:  # noqa: BLE001 - portable registration works from any device
                log.warning("pinning thread: set_device(%s) failed (%s)", index, e)
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, views = item
            try:
                entry = PinnedChunk(key, views, self.register)
            except Exception as e:  # noqa: BLE001 - no pinned copy: the chunk is staged as before
                log.warning("pinning %s failed (%s: %s)", key, type(e).__name__, e)
                with self._lock:
                    self._queued.discard(key)
                    self.counters["errors"] += 1
                continue
            with self._lock:
                self._queued.discard(key)
                self._entries[key] = entry
                self._bytes += entry.nbytes
                self.counters["pinned"] += 1
                victims = self._victims()
            for v in victims:
                _release(v)

    def _victims(self) -> list[PinnedChunk]:
        """Least recently used entries not in use, until within capacity (lock held)."""
        out = []
        for k in list(self._entries):
            if self._bytes <= self.capacity_bytes:
                break
            e = self._entries[k]
            if e.users == 0:
                del self._entries[k]
                self._bytes -= e.nbytes
                self.counters["evicted"] += 1
                out.append(e)
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until nothing is queued (tests, benchmarks); False on timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queued:
                    return True
            time.sleep(0.01)
        return False

    def clear(self) -> None:
        """Drop every entry not in use (benchmarks: a cold start)."""
        with self._lock:
            keep = self.capacity_bytes
            self.capacity_bytes = 0
            victims = self._victims()
            self.capacity_bytes = keep
        for v in victims:
            _release(v)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "bytes_used": self._bytes, "num_chunks": len(self._entries)}

    def close(self) -> None:
        """Stop the pinning thread and release every entry."""
        self._closed = True
        if self._thread is not None:
            try:
                self._queue.put(None, timeout=5)
            except queue.Full:
                pass
            self._thread.join(timeout=30)
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._bytes = 0
        for e in entries:
            _release(e)


def _release(entry: PinnedChunk) -> None:
    try:
        entry.release()
    except Exception as e:  # noqa: BLE001 - a failed unregister must not stop the pinning thread
        log.warning("releasing pinned %s failed (%s: %s)", entry.key, type(e).__name__, e)
