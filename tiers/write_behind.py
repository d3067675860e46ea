"""Write-behind: a put's copies into the tiers below the top one, bounded, in the background,
and readable until they land.

A cache shard (:class:`cluster.cache.shard.CacheShard`) and a :class:`tiers.stack.TierStack`
write a put into their top tier (host memory) at once and hand the object here for the tiers
below (disk, Redis, S3). While a write is queued or running, the chunk may already have been
evicted from the top tier (a small host tier under a burst of puts) and not yet be on disk:
for that window the chunk lived in no tier, so a lookup that had found it in host memory was
followed by a read that found it nowhere, and the vLLM worker recomputed the whole request
(seen in the demo's test: "layer 0 of chunk ... could not be read (missing)").
:meth:`WriteBehind.held` closes the window: it returns the object of a write still pending,
and the owner puts it back into its top tier instead of missing.

Bounds: :data:`MAX_PENDING_WRITES` writes and :data:`MAX_PENDING_WRITE_BYTES` of their
objects, from queued until written to every lower tier. Past either a put's write is
dropped (the owner counts ``writes_dropped``; the shard's metric ``kvblend_writes_dropped``, one
warning), so a slow or stuck tier never makes a put wait. The objects held here are the puts' own
arrays (already counted in the bound), not copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from tiers.keys import ChunkKey
from tiers.tier import Buffer

log = logging.getLogger(__name__)

#: write-downs queued or running (each holds its put's object, pinned in the object store,
#: until written to every lower tier); past it a put's write-down is dropped
MAX_PENDING_WRITES = 256
#: bytes of those objects: a quarter of the 2 GiB default ``object_store_gib`` (16-64 chunks of
#: 8-32 MiB); one object larger than this is still written down when nothing else is pending
MAX_PENDING_WRITE_BYTES = 512 * 2**20


class WriteBehind:
    """Bounded background writes of chunk objects, readable by key while pending.

    Args:
        write: ``write(key, obj, header)``, run on this class's threads: stores one object
            into every lower tier lacking it (and counts its own failures). ``header`` is the
            caller's, opaque here.
        on_drop: called (outside the lock) with ``(pending writes, pending bytes, first)``
            when a write is dropped at the bound; ``first`` for the first drop.
        undo: ``undo(key)``, deletes ``key`` from the lower tiers: run when a write that was
            already running when its chunk was deleted (:meth:`forget`) has landed.
        workers: threads for the writes (own threads: promotions never queue behind them).
        name: their thread name prefix.

    Thread-safe. The bounds are read at each :meth:`submit` from this module (tests lower them).
    Deletes: the owner calls :meth:`forget` first, then deletes from its tiers; a put back
    (:meth:`restore`) never runs beside a :meth:`forget`, so a deleted chunk does not come back.
    """

    def __init__(self, write: Callable[[ChunkKey, Buffer, object], None],
                 on_drop: Callable[[int, int, bool], None], undo: Callable[[ChunkKey], None],
                 workers: int = 4, name: str = "kvblend-write-behind") -> None:
        self._write = write
        self._on_drop = on_drop
        self._undo = undo
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a write's bookkeeping is done
        self._restoring = threading.Lock()  # restore() against forget()
        self._futures: dict[Future, int] = {}  # pending write -> its object's bytes
        self._bytes = 0
        # key -> (object, header, token of its write): a re-put after forget() is another write
        self._held: dict[ChunkKey, tuple[Buffer, object, object]] = {}
        self._dropped = 0

    def __len__(self) -> int:
        """Writes queued or running."""
        with self._lock:
            return len(self._futures)

    def submit(self, key: ChunkKey, obj: Buffer, header) -> bool:
        """Queue ``obj``'s write unless a bound is reached (then drop it). Never waits.

        Returns:
            Whether a write of ``key`` is pending now (this one, or one queued before);
            False when dropped at a bound.

        Raises:
            RuntimeError: after :meth:`close` (as a closed executor does).
        """
        nbytes = memoryview(obj).nbytes
        with self._lock:
            if key in self._held:
                return True
            full = len(self._futures) >= MAX_PENDING_WRITES or (
                bool(self._futures) and self._bytes + nbytes > MAX_PENDING_WRITE_BYTES)
            if full:
                self._dropped += 1
                drop = (len(self._futures), self._bytes, self._dropped == 1)
            else:
                token = object()
                self._held[key] = (obj, header, token)
                try:
                    fut = self._pool.submit(self._run, key, obj, header, token)
                except RuntimeError:  # closed: the caller's mistake, and nothing stays held
                    del self._held[key]
                    raise
                self._futures[fut] = nbytes
                self._bytes += nbytes
        if full:
            self._on_drop(*drop)
            return False
        fut.add_done_callback(lambda f, k=key, t=token: self._done(f, k, t))
        return True

    def _run(self, key: ChunkKey, obj: Buffer, header, token: object) -> None:
        with self._lock:
            entry = self._held.get(key)
        if entry is None or entry[2] is not token:  # forgotten (deleted) before it ran
            return
        self._write(key, obj, header)
        with self._lock:
            forgotten = key not in self._held  # deleted while writing (a re-put is left alone)
        if forgotten:
            self._undo(key)

    def _done(self, fut: Future, key: ChunkKey, token: object) -> None:
        with self._lock:
            self._bytes -= self._futures.pop(fut, 0)
            entry = self._held.get(key)
            if entry is not None and entry[2] is token:
                del self._held[key]
            self._settled.notify_all()
        if not fut.cancelled() and fut.exception() is not None:  # a bug, not a tier fault
            log.error("write-down of %s failed", key, exc_info=fut.exception())

    def held(self, key: ChunkKey) -> tuple[Buffer, object] | None:
        """``(object, header)`` of ``key``'s pending write (the put's array, not a copy), or
        None when none is pending (never written here, already in every lower tier, or
        forgotten)."""
        with self._lock:
            entry = self._held.get(key)
        return None if entry is None else entry[:2]

    def restore(self, key: ChunkKey, put: Callable[[Buffer, object], bool]) -> bool:
        """``put(object, header)`` of ``key``'s pending write (the owner puts it back into its
        top tier), never beside a :meth:`forget`; whether there was one and ``put`` took it."""
        with self._restoring:
            held = self.held(key)
            return held is not None and bool(put(*held))

    def keys(self) -> list[ChunkKey]:
        """Keys whose write is pending."""
        with self._lock:
            return list(self._held)

    def forget(self, keys) -> None:
        """The chunks are being deleted: no longer held, a write of theirs that has not started
        does not run, and one running now is undone when it lands. Waits for a
        :meth:`restore` under way (the caller deletes from its tiers after this)."""
        with self._restoring, self._lock:
            for key in keys:
                self._held.pop(key, None)

    def drain(self, timeout_s: float | None) -> bool:
        """Wait up to ``timeout_s`` (None: no limit) for the writes pending now and their
        bookkeeping; True when all finished."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            pending = list(self._futures)
            while any(f in self._futures for f in pending):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
        return True

    def close(self, wait: bool = True) -> None:
        """Stop taking writes (queued ones are cancelled); ``wait`` for the running ones.
        Idempotent."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
