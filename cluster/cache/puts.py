"""The put path: :class:`PutBound`, the client's bound on unsettled puts (whatever the transport),
and :class:`ShardWriter`, the Ray transport's sends — encoded chunks to their owners, settled,
flushed.

::

    send(key, obj, done)  owner shard's put.remote(str(key), obj as uint8); done(stored) runs
                          once the call settles (Ray completes the call's ref: ObjectRef.future)
    flush(t)              ray.wait for every unsettled put, then each written-to shard's
                          drain(t): its background writes to disk/Redis/S3

A put is fire-and-forget for the caller: the shard validates the object and answers True
(stored) or False (refused); a refused put, a dead owner or no owner at all counts
``put_errors`` — the chunk is then a future miss, never an exception.

Bounds: the client admits a put only while its unsettled puts are under
:data:`MAX_PENDING_PUTS` calls and :data:`MAX_PENDING_PUT_BYTES` bytes (:class:`PutBound`, the one
place for every transport: over the cache agent a put settles when the agent's own send to the
shard settled), so each unsettled call holds its object in the Ray object store and a slot in
the owner's mailbox within that bound. A put never waits for a shard: past the bound the newest
is dropped before it is encoded, counted ``puts_dropped`` (one warning per client).
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

#: unsettled puts of one client (each holds a slot in its owner's mailbox); past it the client
#: drops the newest put (``puts_dropped``)
MAX_PENDING_PUTS = 256
#: bytes of the unsettled puts' objects (each stays in the Ray object store until its call
#: settles): a quarter of the 2 GiB default ``object_store_gib``, 16-64 chunks of 8-32 MiB.
#: A single object larger than this is still sent when nothing else is pending.
MAX_PENDING_PUT_BYTES = 512 * 2**20


class PutBound:
    """The unsettled puts of one client, within :data:`MAX_PENDING_PUTS` /
    :data:`MAX_PENDING_PUT_BYTES` (read when admitting: tests lower them).

    Args:
        count: ``count(counter_name, n)`` of the client (``puts_dropped``).
    """

    def __init__(self, count: Callable[[str, int], None]) -> None:
        self._count = count
        self._lock = threading.Lock()
        self.calls = self.nbytes = self.dropped = 0

    def admit(self, nbytes: int) -> bool:
        """Take room for a put of ``nbytes`` unless the bound is reached (then count it and
        warn once). A single object over the byte bound is still sent when nothing else is
        pending."""
        with self._lock:
            full = self.calls >= MAX_PENDING_PUTS or (self.calls and self.nbytes + nbytes > MAX_PENDING_PUT_BYTES)
            if not full:
                self.calls += 1
                self.nbytes += nbytes
                return True
            self.dropped += 1
            first, calls, pending = self.dropped == 1, self.calls, self.nbytes
        self._count("puts_dropped", 1)
        if first:
            log.warning("kvblend: %d puts (%d bytes) unsettled, the bound (MAX_PENDING_PUTS=%d, "
                        "MAX_PENDING_PUT_BYTES=%d): dropping new puts (counted puts_dropped; warned "
                        "once)", calls, pending, MAX_PENDING_PUTS, MAX_PENDING_PUT_BYTES)
        return False

    def resize(self, old: int, new: int) -> None:
        """An admitted put's bytes are ``new`` now (its object's own size, not the estimate)."""
        with self._lock:
            self.nbytes += new - old

    def release(self, nbytes: int) -> None:
        """An admitted put of ``nbytes`` settled (or was never sent)."""
        with self._lock:
            self.calls -= 1
            self.nbytes -= nbytes


class ShardWriter:
    """Put calls of one transport to the shards, and the wait for them.

    Args:
        router: the transport's :class:`~cluster.cache.router.ShardRouter` (owners, handles).
        count: ``count(counter_name, n)`` — adds to the client's counters (``put_errors``).
    """

    def __init__(self, router: ShardRouter, count: Callable[[str, int], None]) -> None:
        self._router = router
        self._count = count
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._pending: dict[object, ChunkKey] = {}   # unsettled put refs -> key
        self._pending_keys: set[ChunkKey] = set()
        self._put_shards: set[str] = set()   # shards written to since the last flush

    def in_flight(self, key: ChunkKey) -> bool:
        """Whether a put of ``key`` by this writer has not settled yet."""
        with self._lock:
            return key in self._pending_keys

    def send(self, key: ChunkKey, obj, done: Callable[[bool], None]) -> bool:
        """Start the put of one encoded chunk object to ``key``'s owner (never waits);
        ``done(stored)`` once it settled. A put of a key still in flight is not sent again (a
        threaded shard may run two puts of one key in either order: the first one wins).

        Returns:
            False (nothing sent, ``done`` never runs): no registered shard, an owner that is
            suspect or gone (``put_errors``), or ``key`` in flight already.
        """
        groups = self._router.groups([key])
        name = next(iter(groups), None)
        h = self._router.handle(name) if name is not None and self._router.usable(name) else None
        if h is None:
            self._count("put_errors", 1)
            return False
        with self._lock:
            if key in self._pending_keys:
                return False
            self._pending_keys.add(key)
        try:
            ref = h.put.remote(str(key), np.frombuffer(obj, dtype=np.uint8))
        except BaseException:
            with self._lock:
                self._pending_keys.discard(key)
            raise
        with self._lock:
            self._pending[ref] = key
            self._put_shards.add(name)
        ref.future().add_done_callback(lambda fut, ref=ref: self._settle(ref, fut, done))
        return True

    def _settle(self, ref, fut, done: Callable[[bool], None]) -> None:
        """Account one finished put call (a refused put or a dead shard counts ``put_errors``)."""
        try:
            stored = bool(fut.result())
        except Exception:  # noqa: BLE001 - the shard died: the put is lost (a future miss)
            stored = False
        if not stored:
            self._count("put_errors", 1)
        done(stored)
        with self._lock:  # last: a flush that saw this ref done returns after its accounting
            self._pending_keys.discard(self._pending.pop(ref, None))
            self._settled.notify_all()

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
        _, not_done = ray.wait(pending, num_returns=len(pending), timeout=timeout_s) if pending else ([], [])
        with self._lock:  # and for their settling (Ray runs it on its own thread just after)
            settled = self._settled.wait_for(lambda: not any(r in self._pending for r in pending),
                                             max(0.0, deadline - time.monotonic()))
        if not_done or not settled:
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
