"""Hand the vLLM worker's freed heap back to the operating system between requests.

Why (issue 20's soak, 2026-12-02): a worker with the connector allocates and frees tens of
MiB per request — each chunk's layers as they arrive from the cache (~0.9 MiB a layer for a
600-token SmolLM2 chunk), the blend's activations, the canonical KV of stores. glibc keeps
what is freed in its arenas, and once a large block has been freed its dynamic mmap threshold
rises (up to 32 MiB), so even those layer buffers come from the arenas instead of ``mmap``.
Measured in the worker of ``kvblend bench faults --soak`` (``mallinfo2`` and a ``gc`` census
after every load): the heap in use stayed at ~1.05 GiB, the tensors and Python objects were
constant, while the free memory the arenas kept wandered between 0.28 and 0.80 GiB — the
worker's RSS grew +22% over 30 minutes with nothing leaked.

:class:`HeapTrimmer` calls glibc's ``malloc_trim(0)`` (which also returns free pages inside
the arenas, not only at their top) at most once every ``min_interval_s`` seconds, when the
worker asks after a request finished. Where libc has no ``malloc_trim`` (musl, macOS) it does
nothing. Called by :meth:`cluster.vllm.worker.KVBlendWorker.get_finished` on the thread that
runs the model, between engine steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvblend.connector")

#: seconds between two trims at most (a trim that returned 256 MiB of freed 1 MiB blocks took
#: 6 ms on this machine: tests/cluster/vllm/test_heap.py)
MIN_INTERVAL_S = 5.0


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Rate-limited ``malloc_trim(0)`` (see the module docstring).

    Args:
        min_interval_s: seconds between two trims at most (>= 0).
        clock: monotonic seconds (tests pass a fake one).
        trim: the function called with ``0`` (default: libc's ``malloc_trim``; None found:
            :meth:`maybe_trim` never trims).

    Raises:
        ValueError: a negative ``min_interval_s``.
    """

    def __init__(self, min_interval_s: float = MIN_INTERVAL_S, *, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s={min_interval_s} must be >= 0")
        self.min_interval_s = float(min_interval_s)
        self._clock = clock
        self._trim = trim if trim is not None else _libc_malloc_trim()
        self._last: float | None = None

    @property
    def available(self) -> bool:
        """Whether this C library can trim."""
        return self._trim is not None

    def maybe_trim(self) -> float | None:
        """Trim when ``min_interval_s`` passed since the last trim (or none happened yet);
        returns the seconds it took, None when it did not trim. Never raises: a failing trim
        is logged at debug level and counts as not trimmed."""
        if self._trim is None:
            return None
        now = self._clock()
        if self._last is not None and now - self._last < self.min_interval_s:
            return None
        self._last = now
        start = time.perf_counter()
        try:
            self._trim(0)
        except Exception as e:  # noqa: BLE001 - memory hygiene never fails a request
            log.debug("malloc_trim failed: %r", e)
            return None
        return time.perf_counter() - start
