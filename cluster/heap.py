"""Hand a process's freed heap back to the operating system between requests: the vLLM
worker's and the cache agent's (:mod:`cluster.cache.agent`).

Why (issue 20's soak, 2026-12-02): a worker with the connector allocates and frees tens of
MiB per request — each chunk's layers as they arrive from the cache (~0.9 MiB a layer for a
600-token SmolLM2 chunk), the blend's activations, the canonical KV of stores. glibc keeps
what is freed in its arenas, and once a large block has been freed its dynamic mmap threshold
rises (up to 32 MiB), so even those layer buffers come from the arenas instead of ``mmap``.
Measured in the worker of ``kvblend bench faults --soak`` (``mallinfo2`` and a ``gc`` census
after every load): the heap in use stayed at ~1.05 GiB, the tensors and Python objects were
constant, while the free memory the arenas kept wandered between 0.28 and 0.80 GiB (that
soak's larger growth, +3 GiB, was another cause: layers held in reference cycles until a full
collection, fixed in :mod:`cluster.vllm.worker_source`). With both, the worker's RSS at rest
was x1.00 after a 30-minute soak (docs/benchmarks.md, Faults). The cache agent receives each stored
chunk's KV as one buffer of a few MiB and queues those buffers while a slow or stopped shard
holds its puts: in the soak of 2026-12-03 its main heap kept +52 MiB freed that way from a
shard_sigstop phase on (``/proc/PID/smaps``: the ``[heap]`` mapping; ``malloc_trim(0)`` called
in it through gdb gave the 55 MiB back).

:class:`HeapTrimmer` calls glibc's ``malloc_trim(0)`` (which also returns free pages inside
the arenas, not only at their top) at most once every ``min_interval_s`` seconds, when the
process asks (a request finished, a large buffer was freed). A request inside the interval is
not dropped: one trailing trim runs on a timer thread when the interval ends, so a worker that
goes idle right after a burst (vLLM stops calling the connector when no request runs) still
hands its freed heap back. Where libc has no ``malloc_trim`` (musl, macOS) it does nothing. Called by
:meth:`cluster.vllm.worker.KVBlendWorker.get_finished` on the thread that runs the model,
between engine steps (:meth:`HeapTrimmer.close` from the worker's shutdown), and by the cache
agent after it answered a ``put`` or ``objects`` request, on the thread that answered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvblend.connector")

#: seconds between two trims at most (a trim that returned 256 MiB of freed 1 MiB blocks took
#: 6 ms on this machine: tests/cluster/test_heap.py)
MIN_INTERVAL_S = 5.0


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none.

    The C library this process already runs on (``CDLL(None)``: its own symbols) before
    ``ctypes.util.find_library``, which runs ``ldconfig``/``gcc`` in a child process on Linux
    (once per worker, source and agent start-up)."""
    for name in (None, "libc.so.6"):
        try:
            fn = ctypes.CDLL(name).malloc_trim
            break
        except (OSError, AttributeError):
            continue
    else:
        try:
            fn = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
        except (OSError, AttributeError, TypeError):
            return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Rate-limited ``malloc_trim(0)`` with one trailing trim (see the module docstring).

    Args:
        min_interval_s: seconds between two trims at least (>= 0).
        on_trim: called with the seconds each trim took (the worker's counters), on the
            thread that trimmed; its exceptions are logged at debug level.
        clock: monotonic seconds (tests pass a fake one).
        trim: the function called with ``0`` (default: libc's ``malloc_trim``; None found:
            :meth:`request` never trims).
        timer: ``timer(delay_s, fn)`` returning a started-on-``start()`` object with
            ``cancel()`` (default: a daemon :class:`threading.Timer`; tests pass a fake).

    Raises:
        ValueError: a negative ``min_interval_s``.
    """

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S, *,
                 on_trim: Callable[[float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None,
                 timer: Callable[[float, Callable[[], None]], object] | None = None) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s={min_interval_s} must be >= 0")
        self.min_interval_s = float(min_interval_s)
        self._on_trim = on_trim
        self._clock = clock
        self._trim = trim if trim is not None else _libc_malloc_trim()
        self._timer_factory = timer if timer is not None else _daemon_timer
        self._lock = threading.Lock()  # held while trimming and while the state changes
        self._last: float | None = None
        self._pending = None  # the trailing trim's timer, at most one
        self._closed = False

    @property
    def available(self) -> bool:
        """Whether this C library can trim."""
        return self._trim is not None

    def request(self) -> float | None:
        """Ask for a trim (the worker: a request finished or a load ended). Trims now when
        ``min_interval_s`` passed since the last trim, and returns the seconds it took;
        otherwise arms one trailing trim for when the interval ends (none when one is armed
        already) and returns None. Never blocks behind a trim running on the timer thread
        (returns None then) and never raises."""
        if self._trim is None or self._closed or not self._lock.acquire(blocking=False):
            return None
        try:
            now = self._clock()
            if self._last is None or now - self._last >= self.min_interval_s:
                return self._trim_locked(now)
            if self._pending is None:
                self._pending = self._timer_factory(self._last + self.min_interval_s - now, self._trailing)
                self._pending.start()
            return None
        finally:
            self._lock.release()

    def close(self) -> None:
        """Cancel the armed trailing trim; later requests do nothing (worker shutdown)."""
        with self._lock:
            self._closed = True
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None

    def _trailing(self) -> None:
        with self._lock:
            self._pending = None
            if not self._closed:
                self._trim_locked(self._clock())

    def _trim_locked(self, now: float) -> float | None:
        self._last = now
        if self._pending is not None:  # this trim covers what the trailing one was for
            self._pending.cancel()
            self._pending = None
        start = time.perf_counter()
        try:
            self._trim(0)
        except Exception as e:  # noqa: BLE001 - memory hygiene never fails a request
            log.debug("malloc_trim failed: %r", e)
            return None
        took = time.perf_counter() - start
        if self._on_trim is not None:
            try:
                self._on_trim(took)
            except Exception as e:  # noqa: BLE001
                log.debug("heap trim callback failed: %r", e)
        return took


def _daemon_timer(delay_s: float, fn: Callable[[], None]) -> threading.Timer:
    t = threading.Timer(max(0.0, delay_s), fn)
    t.daemon = True
    return t
