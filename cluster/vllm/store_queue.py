"""The worker half's stores: a queue of canonical-KV computes, and puts on an I/O thread.

A chunk segment is stored as its *canonical* KV (standalone, positions ``0..n-1``), which the
prompt that brought it never computed (there it sat after other segments). Computing it runs
the model, so it happens on the worker's own thread, never concurrently with vLLM (vLLM's CPU
GEMMs share oneDNN scratch memory, so a second thread running the model corrupts both), and
never in the step that computes the request's own prompt, so it never delays a first token:

* :meth:`StoreQueue.add` queues a request's segments (FIFO by request);
* :meth:`StoreQueue.drain`, called from ``wait_for_save`` of later steps, computes about
  ``budget_tokens`` of them per step (a whole segment at least); steps with prefill tokens skip
  the queue unless its oldest item waited :data:`STORE_MAX_DEFER_S`; one batched ``contains``
  per request first drops the segments another process already stored;
* the puts, flushes and the ``store`` event of each request go to a one-thread pool
  (``kvblend-store-io``) that never runs the model;
* :meth:`StoreQueue.finished_sending` reports requests whose segments are all computed and
  that vLLM has finished, so vLLM can free the blocks ``request_finished`` held; a finished
  request is reported at the latest :data:`MAX_BLOCK_HOLD_S` after vLLM finished it (issue 20:
  a long queue never pins KV blocks). Its segments stay queued — a canonical compute needs
  the token ids, not the blocks — and run in later steps (with no traffic left, vLLM stops
  stepping and they wait for the next request's steps).

Prefix chunks need no compute (their KV is in the paged cache after the forward): the worker
gathers them and :meth:`StoreQueue.put_prefix` puts them on the same I/O thread.
Failure behaviour: a failed compute or put is a future miss, recorded in the ``store`` event's
``error`` and warned about once; nothing here raises into vLLM.

Backpressure: the puts waiting for the I/O thread hold their KV, so they are bounded
(:data:`MAX_STORE_IO_ITEMS` chunks, :data:`MAX_STORE_IO_BYTES` bytes, queued or running). Past
the bound the newest store is dropped — a canonical segment before its compute, a prefix batch
whole — counted ``store_dropped`` (and ``dropped`` in the request's ``store`` event), warned
about once; vLLM's threads never wait for storage. ``flush`` waits for what was queued.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cluster.vllm.events import EventLog, WarnOnce

if TYPE_CHECKING:
    from cluster.vllm.metrics import Counters
    from tiers.keys import ChunkKey

#: a store queued longer than this (seconds) is computed even in a step with prefill tokens.
STORE_MAX_DEFER_S = 2.0
#: chunks whose puts are queued or running on the I/O thread; past it the newest is dropped
#: (a stuck or slow client then costs no memory beyond the bound and no model time)
MAX_STORE_IO_ITEMS = 64
#: seconds after vLLM finished a request that its blocks may stay held for its pending stores
MAX_BLOCK_HOLD_S = 10.0
#: bytes of their KV tensors (canonical KV on the CPU, gathered prefix chunks): 16-64 chunks
#: of 8-32 MiB; one batch larger than this is still queued when nothing else is
MAX_STORE_IO_BYTES = 512 * 2**20


@dataclass
class _PendingStore:
    """Canonical segments of one request still to compute and put."""

    request_id: str
    segments: deque = field(default_factory=deque)   # (ChunkKey, token ids)
    enqueued_s: float = 0.0
    finished: bool = False      # vLLM finished the request (its id came in finished_req_ids)
    stored: int = 0
    skipped: int = 0
    dropped: int = 0            # segments dropped at the I/O bound (not computed)
    tokens: int = 0
    seconds: float = 0.0
    error: str | None = None


def _nbytes(t: torch.Tensor) -> int:
    return t.element_size() * t.nelement()


class StoreQueue:
    """Store work of one worker (see the module docstring).

    Args:
        client: the cache client (``contains``, ``put``, ``flush``); None: nothing is stored.
        canonical_kv: token ids -> their canonical KV ``[L, 2, T, H, D]`` on the CPU; runs the
            model, so it is only called from :meth:`drain` (the worker's thread).
        remember: ``(key, kv)`` after a segment's KV is computed (the worker's gpu tier).
        counters, events, warn: where stores are reported.
        thread_initializer: run at the start of the I/O thread
            (:func:`cluster.vllm.affinity.unpin_thread` in a vLLM CPU worker).
    """

    def __init__(self, client, *, canonical_kv: Callable[[list[int]], torch.Tensor],
                 remember: Callable[[ChunkKey, torch.Tensor], None], counters: Counters,
                 events: EventLog, warn: WarnOnce, thread_initializer: Callable[[], None] | None = None) -> None:
        self.client = client
        self._canonical_kv = canonical_kv
        self._remember = remember
        self._counters = counters
        self._events = events
        self._warn = warn
        self._thread_initializer = thread_initializer
        self._io_pool: ThreadPoolExecutor | None = None   # puts only; never runs the model
        self._io_futures: list = []
        self._io_lock = threading.Lock()      # the bound's accounting (the I/O thread releases)
        self._io_items = 0                    # chunks queued or running on the I/O thread
        self._io_bytes = 0                    # their KV bytes
        #: stores dropped at the bound (also counted as ``store_dropped``)
        self.store_dropped = 0
        self._queue: OrderedDict[str, _PendingStore] = OrderedDict()  # FIFO by request
        self._done: set[str] = set()          # all segments computed, waiting for vLLM's finish
        self._finished_at: dict[str, float] = {}  # finished by vLLM while their store was pending
        self._released: set[str] = set()      # reported after MAX_BLOCK_HOLD_S, still queued
        #: requests whose blocks were released before their stores were computed
        self.released_early = 0

    def add(self, request_id: str, segments: list[tuple[ChunkKey, tuple[int, ...]]], now: float) -> None:
        """Queue canonical ``segments`` ``(key, token ids)`` of a request (``now``: monotonic s)."""
        pend = self._queue.get(request_id)
        if pend is None:
            pend = self._queue[request_id] = _PendingStore(request_id, enqueued_s=now)
        pend.segments.extend(segments)

    def drain(self, has_prefill: bool, budget_tokens: int | None) -> None:
        """Compute queued canonical segments, oldest request first, about ``budget_tokens``
        tokens (at least one segment; ``None``: everything). In a step with prefill tokens
        (or async loads) only work older than :data:`STORE_MAX_DEFER_S` runs."""
        if not self._queue:
            return
        oldest = next(iter(self._queue.values()))
        if has_prefill and time.monotonic() - oldest.enqueued_s < STORE_MAX_DEFER_S:
            return
        spent = 0
        while self._queue and (budget_tokens is None or spent < budget_tokens):
            pend = next(iter(self._queue.values()))
            if pend.segments and pend.stored == pend.skipped == 0 and pend.error is None:
                self._drop_present(pend)
            if pend.segments:
                key, ids = pend.segments.popleft()
                spent += self._store_segment(pend, key, ids)
            if not pend.segments:
                del self._queue[pend.request_id]
                if pend.request_id in self._released:  # vLLM freed its blocks already
                    self._released.discard(pend.request_id)
                else:
                    self._done.add(pend.request_id)
                self._io_submit(self._finish_store, pend)

    def _drop_present(self, pend: _PendingStore) -> None:
        """One batched ``contains`` for a request's segments: skip those already cached."""
        try:
            present = self.client.contains([k for k, _ in pend.segments])
        except Exception as e:  # noqa: BLE001 - unknown: compute them (put is idempotent)
            self._warn("contains", "kvblend: contains failed (%s: %s)", type(e).__name__, e)
            return
        keep = deque(item for item, have in zip(pend.segments, present, strict=True) if not have)
        pend.skipped += len(pend.segments) - len(keep)
        pend.segments = keep

    def _store_segment(self, pend: _PendingStore, key: ChunkKey, ids: tuple[int, ...]) -> int:
        """Canonical KV of one segment (``engine.prefill`` at positions ``0..n-1``), handed to
        the I/O thread. Returns the tokens computed. Errors are recorded, never raised."""
        if self._io_full(1, 0):  # its put could not be queued: skip the compute too
            self._dropped(1)
            pend.dropped += 1
            return 0
        start = time.perf_counter()
        try:
            kv = self._canonical_kv(list(ids))  # [L, 2, T, H, D]
            if not bool(torch.isfinite(kv).all()):
                raise RuntimeError(f"non-finite canonical KV for {key}; not stored")
            if self._io_submit_bounded(1, _nbytes(kv), self.client.put, key, kv):
                pend.stored += 1
                pend.tokens += len(ids)
            else:
                self._dropped(1)
                pend.dropped += 1
            self._remember(key, kv)
        except Exception as e:  # noqa: BLE001 - a failed store is a future miss
            pend.error = f"{type(e).__name__}: {e}"
            self._warn("store", "kvblend: store for request %s failed (%s)", pend.request_id, pend.error)
        pend.seconds += time.perf_counter() - start
        return len(ids)

    def put_prefix(self, request_id: str, prefix: list[tuple[ChunkKey, torch.Tensor]]) -> None:
        """Put gathered prefix chunks ``(key, kv[L, 2, T, H, D])`` on the I/O thread (the
        whole batch is dropped, ``store_dropped``, when it does not fit the bound)."""
        nbytes = sum(_nbytes(kv) for _, kv in prefix)
        if not self._io_submit_bounded(len(prefix), nbytes, self._put_prefix, request_id, prefix):
            self._dropped(len(prefix))
            self._count_store(request_id, 0, 0, 0, 0.0, None, dropped=len(prefix))

    def _io_submit(self, fn, *args):
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvblend-store-io",
                                               initializer=self._thread_initializer)
        self._io_futures = [f for f in self._io_futures if not f.done()]
        fut = self._io_pool.submit(fn, *args)
        self._io_futures.append(fut)
        return fut

    def _io_over(self, items: int, nbytes: int) -> bool:
        """Whether ``items`` chunks of ``nbytes`` more would pass the bound (anything fits
        when nothing is queued). Call with ``_io_lock`` held."""
        return self._io_items > 0 and (self._io_items + items > MAX_STORE_IO_ITEMS
                                       or self._io_bytes + nbytes > MAX_STORE_IO_BYTES)

    def _io_full(self, items: int, nbytes: int) -> bool:
        with self._io_lock:
            return self._io_over(items, nbytes)

    def _io_submit_bounded(self, items: int, nbytes: int, fn, *args) -> bool:
        """Queue ``fn(*args)`` holding ``items`` chunks of ``nbytes`` on the I/O thread unless
        that passes the bound; never waits. Returns whether it was queued."""
        with self._io_lock:
            if self._io_over(items, nbytes):
                return False
            self._io_items += items
            self._io_bytes += nbytes
        try:
            fut = self._io_submit(fn, *args)
        except BaseException:
            self._io_release(items, nbytes)
            raise
        fut.add_done_callback(lambda _f: self._io_release(items, nbytes))
        return True

    def _io_release(self, items: int, nbytes: int) -> None:
        with self._io_lock:
            self._io_items -= items
            self._io_bytes -= nbytes

    def _dropped(self, n: int) -> None:
        """Count ``n`` chunks dropped at the bound (``store_dropped``), warn once."""
        with self._io_lock:
            self.store_dropped += n
            items, nbytes = self._io_items, self._io_bytes
        self._counters.bump(store_dropped=n)
        self._warn("store_dropped", "kvblend: %d chunks (%d bytes) waiting to be stored, the bound "
                   "(MAX_STORE_IO_ITEMS=%d, MAX_STORE_IO_BYTES=%d): dropping new stores "
                   "(counted store_dropped; warned once)", items, nbytes, MAX_STORE_IO_ITEMS,
                   MAX_STORE_IO_BYTES)

    def _finish_store(self, pend: _PendingStore) -> None:
        """I/O thread, after the request's puts (FIFO): flush, count, one ``store`` event."""
        error = pend.error
        try:
            if pend.stored and not self.client.flush(timeout_s=60.0):
                error = error or "flush timed out"
        except Exception as e:  # noqa: BLE001
            error = error or f"{type(e).__name__}: {e}"
        self._count_store(pend.request_id, pend.stored, pend.skipped, pend.tokens, pend.seconds, error,
                          dropped=pend.dropped)

    def _put_prefix(self, request_id: str, prefix) -> None:
        """I/O thread: put gathered prefix chunks ``(key, kv[L, 2, T, H, D])``, flush, count."""
        start = time.perf_counter()
        stored = tokens = 0
        error = None
        try:
            for key, kv in prefix:
                self.client.put(key, kv.cpu(), positions=None)
                stored += 1
                tokens += kv.shape[2]
            if stored and not self.client.flush(timeout_s=60.0):
                error = "flush timed out"
        except Exception as e:  # noqa: BLE001 - a failed store is a future miss
            error = f"{type(e).__name__}: {e}"
            self._warn("store", "kvblend: store for request %s failed (%s)", request_id, error)
        self._count_store(request_id, stored, 0, tokens, time.perf_counter() - start, error)

    def _count_store(self, request_id, stored, skipped, tokens, seconds, error, dropped=0) -> None:
        self._counters.bump(stored_chunks=stored, stored_tokens=tokens, store_skipped=skipped, store_s=seconds)
        self._events.write("store", request_id=request_id, stored=stored, skipped=skipped,
                           tokens=tokens, seconds=seconds, error=error, dropped=dropped)

    def finished_sending(self, finished_req_ids: set[str], now: float | None = None) -> set[str]:
        """Requests finished by vLLM (in this call or an earlier one) whose canonical segments
        are all computed (their puts may continue on the I/O thread), and those finished
        :data:`MAX_BLOCK_HOLD_S` or more ago whatever their stores (counted in
        :attr:`released_early`, warned about once; their segments stay queued). Each request is
        reported once. ``now``: monotonic seconds (default: the clock)."""
        now = time.monotonic() if now is None else now
        held = set(self._queue) | self._done
        for rid in set(finished_req_ids) & held:
            self._finished_at.setdefault(rid, now)
        done = {r for r in self._finished_at if r in self._done}
        overdue = {r for r, t in self._finished_at.items() if r not in done and now - t >= MAX_BLOCK_HOLD_S}
        if overdue:
            self._released |= overdue
            self.released_early += len(overdue)
            self._warn("block_hold", "kvblend: %d finished requests held their KV blocks %.0f s "
                       "(MAX_BLOCK_HOLD_S) waiting for their stores; released, the stores continue "
                       "in later steps (warned once)", len(overdue), MAX_BLOCK_HOLD_S)
        for r in done | overdue:
            del self._finished_at[r]
        self._done -= done
        return done | overdue

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Compute every queued store and wait for the puts; True when all finished within
        ``timeout_s``. Runs the model: call it only on the worker's own thread, where vLLM is
        not running the model."""
        deadline = time.monotonic() + timeout_s
        self.drain(False, None)
        for f in list(self._io_futures):
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                return False
        return self.client.flush(timeout_s=max(0.0, deadline - time.monotonic())) if self.client else True

    def shutdown(self) -> None:
        """Stop the I/O thread once its queued puts are done (does not wait for them)."""
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=False)
