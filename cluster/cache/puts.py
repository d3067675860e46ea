"""``ShardWriter``: the client's put path — send encoded chunks to their owners, track, flush.

::

    send(key, obj)   owner shard's put.remote(str(key), obj as uint8); the call's ref is kept
                     until it settles (at most MAX_PENDING_PUTS before settling finished ones)
    flush(t)         ray.wait for every pending put, then each written-to shard's drain(t):
                     its background writes to disk/Redis/S3

A put is fire-and-forget for the caller: the shard validates the object and answers
True (stored) or False (refused); a refused put, a dead owner or no owner at all counts
``put_errors`` — the chunk is then a future miss, never an exception.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from cluster.cache.router import ShardRouter
from tiers.keys import ChunkKey

#: put calls in flight before :meth:`ShardWriter.send` settles the finished ones
MAX_PENDING_PUTS = 256


class ShardWriter:
    """Put calls of one client to the shards, and the wait for them.

    Args:
        router: the client's :class:`~cluster.cache.router.ShardRouter` (owners, handles).
        count: ``count(counter_name, n)`` — adds to the client's counters (``puts``,
            ``put_errors``).
    """

    def __init__(self, router: ShardRouter, count: Callable[[str, int], None]) -> None:
        self._router = router
        self._count = count
        self._lock = threading.Lock()
        self._pending: dict[object, tuple[str, ChunkKey]] = {}   # put call's ref -> (shard, key)
        self._pending_keys: set[ChunkKey] = set()
        self._put_shards: set[str] = set()   # shards written to since the last flush

    def in_flight(self, key: ChunkKey) -> bool:
        """Whether a put of ``key`` by this client has not settled yet."""
        with self._lock:
            return key in self._pending_keys

    def send(self, key: ChunkKey, obj: bytes) -> None:
        """Start the put of one encoded chunk object to ``key``'s owner (no wait).

        No registered shard, or an owner that is suspect or gone, counts ``put_errors``.
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
        ref = h.put.remote(str(key), np.frombuffer(obj, dtype=np.uint8))
        with self._lock:
            self._pending[ref] = (name, key)
            self._pending_keys.add(key)
            self._put_shards.add(name)
            num_pending = len(self._pending)
        self._count("puts", 1)
        if num_pending >= MAX_PENDING_PUTS:
            self._reap()

    def _settle(self, done: list) -> None:
        """Account finished put calls (a refused put or a dead shard counts ``put_errors``)."""
        import ray

        for ref in done:
            try:
                ok = ray.get(ref, timeout=0.1)
            except Exception:  # noqa: BLE001 - the shard died: the put is lost (a future miss)
                ok = False
            if not ok:
                self._count("put_errors", 1)
        with self._lock:
            for ref in done:
                _, key = self._pending.pop(ref, (None, None))
                self._pending_keys.discard(key)

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
