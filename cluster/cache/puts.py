"""``ShardWriter``: the client's put path — send encoded chunks to their owners, track, flush.

::

    send(key, obj)   owner shard's put.remote(str(key), obj as uint8); the call's ref is kept
                     until it settles; at most MAX_PENDING_PUTS calls / MAX_PENDING_PUT_BYTES
                     in flight, past that the newest put is dropped (``puts_dropped``)
    flush(t)         ray.wait for every pending put, then each written-to shard's drain(t):
                     its background writes to disk/Redis/S3

A put is fire-and-forget for the caller: the shard validates the object and answers
True (stored) or False (refused); a refused put, a dead owner or no owner at all counts
``put_errors`` — the chunk is then a future miss, never an exception.

Backpressure: a put never waits for a shard. Each unsettled call holds its object in the
Ray object store and a slot in the owner's mailbox, so when :data:`MAX_PENDING_PUTS` calls or
:data:`MAX_PENDING_PUT_BYTES` bytes are unsettled (after settling the finished ones, without
waiting) the put being sent — the newest — is dropped: counted ``puts_dropped`` (one warning
per writer), the chunk a future miss. ``flush`` still waits for every put that was sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from cluster.cache.router import ShardRouter
from tiers.keys import ChunkKey

log = logging.getLogger("kvblend.client")

#: unsettled put calls of one client (each holds a slot in its owner's mailbox); at this many,
#: :meth:`ShardWriter.send` settles the finished ones and, if still full, drops the new put
MAX_PENDING_PUTS = 256
#: bytes of the unsettled puts' objects (each stays in the Ray object store until its call
#: settles): a quarter of the 2 GiB default ``object_store_gib``, 16-64 chunks of 8-32 MiB.
#: A single object larger than this is still sent when nothing else is pending.
MAX_PENDING_PUT_BYTES = 512 * 2**20


class ShardWriter:
    """Put calls of one client to the shards, and the wait for them.

    Args:
        router: the client's :class:`~cluster.cache.router.ShardRouter` (owners, handles).
        count: ``count(counter_name, n)`` — adds to the client's counters (``puts``,
            ``put_errors``, ``puts_dropped``).
    """

    def __init__(self, router: ShardRouter, count: Callable[[str, int], None]) -> None:
        self._router = router
        self._count = count
        self._lock = threading.Lock()
        self._pending: dict[object, tuple[str, ChunkKey, int]] = {}  # ref -> (shard, key, bytes)
        self._pending_keys: set[ChunkKey] = set()
        self._put_shards: set[str] = set()   # shards written to since the last flush
        self._slots = 0          # puts admitted and not yet settled (sent or being sent)
        self._slot_bytes = 0     # their object bytes
        #: puts dropped because the bound was reached (also counted as ``puts_dropped``)
        self.puts_dropped = 0

    def in_flight(self, key: ChunkKey) -> bool:
        """Whether a put of ``key`` by this client has not settled yet."""
        with self._lock:
            return key in self._pending_keys

    def send(self, key: ChunkKey, obj: bytes) -> None:
        """Start the put of one encoded chunk object to ``key``'s owner (never waits).

        No registered shard, or an owner that is suspect or gone, counts ``put_errors``;
        past the bound (see the module docstring) the put is dropped, ``puts_dropped``.
        """
        groups = self._router.groups([key])
        if not groups:
            self._count("put_errors", 1)
            return
        name = next(iter(groups))
        h = self._router.handle(name) if self._router.usable(name) else None
        if h is None:
            self._count("put_errors", 1)
            return
        nbytes = len(obj)
        if not self._admit(nbytes):
            self._reap()  # settle finished calls (no wait), then try once more
            if not self._admit(nbytes):
                self._dropped()
                return
        try:
            ref = h.put.remote(str(key), np.frombuffer(obj, dtype=np.uint8))
        except BaseException:
            self._release(1, nbytes)
            raise
        with self._lock:
            self._pending[ref] = (name, key, nbytes)
            self._pending_keys.add(key)
            self._put_shards.add(name)
        self._count("puts", 1)

    def _admit(self, nbytes: int) -> bool:
        """Take a slot for a put of ``nbytes`` unless the bound is reached."""
        with self._lock:
            if self._slots >= MAX_PENDING_PUTS or (
                    self._slots and self._slot_bytes + nbytes > MAX_PENDING_PUT_BYTES):
                return False
            self._slots += 1
            self._slot_bytes += nbytes
            return True

    def _release(self, n: int, nbytes: int) -> None:
        with self._lock:
            self._slots -= n
            self._slot_bytes -= nbytes

    def _dropped(self) -> None:
        """Count a put dropped at the bound; warn on the first only."""
        with self._lock:
            self.puts_dropped += 1
            first = self.puts_dropped == 1
        self._count("puts_dropped", 1)
        if first:
            log.warning("kvblend: %d puts (%d bytes) unsettled, the bound "
                        "(MAX_PENDING_PUTS=%d, MAX_PENDING_PUT_BYTES=%d): dropping new puts "
                        "(counted puts_dropped; warned once)", self._slots, self._slot_bytes,
                        MAX_PENDING_PUTS, MAX_PENDING_PUT_BYTES)

    def _settle(self, done: list) -> None:
        """Account finished put calls (a refused put or a dead shard counts ``put_errors``);
        each is accounted once, also when a reap and a flush settle it concurrently."""
        import ray

        with self._lock:
            mine = [ref for ref in done if ref in self._pending]
            for ref in mine:
                _, key, nbytes = self._pending.pop(ref)
                self._pending_keys.discard(key)
                self._slots -= 1
                self._slot_bytes -= nbytes
        for ref in mine:
            try:
                ok = ray.get(ref, timeout=0.1)
            except Exception:  # noqa: BLE001 - the shard died: the put is lost (a future miss)
                ok = False
            if not ok:
                self._count("put_errors", 1)

    def _reap(self) -> None:
        """Settle finished puts without waiting, so a client that never flushes stays bounded."""
        import ray

        with self._lock:
            pending = list(self._pending)
        if pending:
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
            self._settle(done)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait up to ``timeout_s`` for pending puts and the shards' writes to lower tiers.

        Returns:
            False when puts are still in flight after ``timeout_s`` or a shard written to
            since the last flush reports background writes still pending; else True (every
            put finished, stored or refused). A shard that does not answer its ``drain`` call
            is marked suspect (:meth:`ShardRouter.failed`) and does not make the result False.
        """
        import ray

        deadline = time.monotonic() + timeout_s
        with self._lock:
            pending = list(self._pending)
            shards = list(self._put_shards)
        done, not_done = ray.wait(pending, num_returns=len(pending), timeout=timeout_s) if pending else ([], [])
        self._settle(done)
        if not_done:
            return False
        drains = {}
        for name in shards:
            h = self._router.handle(name)
            if h is not None:
                drains[name] = h.drain.remote(max(0.0, deadline - time.monotonic()))
        all_ok = True
        for name, ref in drains.items():
            try:
                all_ok &= bool(ray.get(ref, timeout=max(0.1, deadline - time.monotonic() + 1)))
            except Exception as e:  # noqa: BLE001
                self._router.failed(name, e)
        with self._lock:
            self._put_shards.difference_update(shards)
        return all_ok
