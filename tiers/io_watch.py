"""Per-call deadline for a tier whose calls cannot be interrupted: local file I/O.

A read or write of a local file runs in the calling thread, and a stalled device (a hung
NFS or FUSE mount, a failing disk, a FIFO where a file should be) blocks that thread in the
kernel where Python cannot cancel it. Redis and S3 get per-call deadlines from their socket
timeouts (``io_timeout_s``); a file gets them from an :class:`IoWatch`:

* every call registers itself (:meth:`IoWatch.begin`) and deregisters when it returns
  (:meth:`IoWatch.end`);
* while any registered call has run longer than ``timeout_s``, the tier is *stalled*: every
  new call is refused at once (a miss or a failed put, counted ``io_refused``) instead of
  queueing behind the stuck one — so threads never pile up on a dead device, and a caller's
  stage deadline (``lookup_timeout_s``, ``load_timeout_s``) is never spent on it;
* a call that returns after ``timeout_s`` is counted (``io_timeouts``); what it returns is
  still valid (a read returns whole, checked bytes; a write is atomic) and is used;
* the tier leaves the stalled state when its late calls return. Each change of state is
  logged once (a warning when stalling, info when recovered).

The caller that was already inside the stuck call stays there; the stage above it bounds its
wait (a shard's lookup pool and a client's ``call_timeout_s``). Cost: one lock and a
``time.monotonic`` per call. Thread-safe.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

log = logging.getLogger(__name__)

#: counters :meth:`IoWatch.stats` reports
COUNTERS = ("io_timeouts", "io_refused")


class IoWatch:
    """The per-call deadline of one tier (see the module docstring).

    Args:
        timeout_s: seconds one call may run before the tier counts as stalled; ``None``
            disables the watch (every call is admitted, nothing is counted).
        name: the tier's name, for the log lines.

    Raises:
        ValueError: ``timeout_s`` is not positive.
    """

    def __init__(self, timeout_s: float | None, name: str = "disk") -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: must be positive (or None)")
        self.timeout_s = timeout_s
        self.name = name
        self._lock = threading.Lock()
        self._inflight: dict[int, float] = {}  # token -> monotonic start
        self._tokens = itertools.count(1)
        self._stalled = False
        self._stats = dict.fromkeys(COUNTERS, 0)

    def begin(self) -> int | None:
        """Register a call about to start. Returns its token (pass it to :meth:`end`), ``0``
        when the watch is off, or ``None`` when the tier is stalled: the caller must not
        start the call (it is a miss / a failed put, already counted ``io_refused``)."""
        if self.timeout_s is None:
            return 0
        now = time.monotonic()
        with self._lock:
            if self._past_deadline(now):
                self._stats["io_refused"] += 1
                return None
            token = next(self._tokens)
            self._inflight[token] = now
            return token

    def end(self, token: int) -> None:
        """Deregister the call of ``token`` (from :meth:`begin`); counts it in
        ``io_timeouts`` when it ran past ``timeout_s``. Call it in a ``finally``."""
        if not token:
            return
        now = time.monotonic()
        with self._lock:
            start = self._inflight.pop(token, None)
            if start is not None and now - start > self.timeout_s:
                self._stats["io_timeouts"] += 1
            self._past_deadline(now)

    @property
    def stalled(self) -> bool:
        """Whether a call now in flight has run past ``timeout_s`` (new calls are refused)."""
        if self.timeout_s is None:
            return False
        with self._lock:
            return self._past_deadline(time.monotonic())

    def stats(self) -> dict[str, int]:
        """``io_timeouts`` (calls that returned late) and ``io_refused`` (calls not started
        because the tier was stalled)."""
        with self._lock:
            return dict(self._stats)

    def _past_deadline(self, now: float) -> bool:
        """Whether a call in flight is past the deadline; logs a change of state (lock held)."""
        stalled = any(now - start > self.timeout_s for start in self._inflight.values())
        if stalled != self._stalled:
            self._stalled = stalled
            if stalled:
                log.warning("%s tier: a call has run over %.3g s (io_timeout_s): stalled, new calls are "
                            "misses until it returns", self.name, self.timeout_s)
            else:
                log.info("%s tier: stalled calls returned; calls admitted again", self.name)
        return stalled
