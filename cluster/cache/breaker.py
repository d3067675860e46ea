"""``TierBreaker``: a per-tier circuit breaker for the shard's lookups (issue #20).

States and transitions (one log line and one ``on_change(tier, old, new)`` per change)::

    closed     every lookup reads the tier; after ``failures`` consecutive failed lookups
               (a read that missed the lookup deadline, or raised) -> open
    open       lookups skip the tier (its keys are misses there) for ``cooldown_s`` seconds,
               then the next lookup -> half_open
    half_open  that lookup may make one probe read: success -> closed, failure -> open
               (a new cool-down); while the probe is out other lookups skip the tier

Outcomes are reported once per lookup call and tier (:meth:`record`), so one slow call of many
keys counts as one failure, not one per key. Thread-safe; ``clock`` is injectable for tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvblend.shard")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: consecutive failed lookups in a tier that open its breaker
BREAKER_FAILURES = 3
#: seconds an open breaker skips its tier before one probe
BREAKER_COOLDOWN_S = 5.0

#: what :meth:`TierBreaker.allow` grants a lookup
ALL, PROBE = "all", "probe"


class TierBreaker:
    """The breaker of one tier.

    Args:
        tier: the tier's name (for the log line and ``on_change``).
        failures: consecutive failed lookups that open it (>= 1).
        cooldown_s: seconds it stays open before a probe (> 0).
        on_change: ``on_change(tier, old_state, new_state)`` after each state change.
        owner: who owns it, for the log line (the shard's name).
        clock: seconds, monotonic.
    """

    def __init__(self, tier: str, failures: int = BREAKER_FAILURES,
                 cooldown_s: float = BREAKER_COOLDOWN_S,
                 on_change: Callable[[str, str, str], None] | None = None, owner: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError(f"failures={failures} must be >= 1 and cooldown_s={cooldown_s} > 0")
        self.tier = tier
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.state = CLOSED
        self.consecutive = 0
        self._on_change = on_change
        self._owner = owner
        self._clock = clock
        self._opened_at = 0.0
        self._probing = False
        self._lock = threading.Lock()

    def allow(self) -> str | None:
        """What one lookup may do in the tier: :data:`ALL` (closed), :data:`PROBE` (one read:
        the cool-down is over; the caller must then :meth:`record`) or None (skip it)."""
        with self._lock:
            if self.state == CLOSED:
                return ALL
            if self.state == OPEN:
                if self._clock() - self._opened_at < self.cooldown_s:
                    return None
                change = self._set(HALF_OPEN)
            elif self._probing:
                return None
            else:
                change = None
            self._probing = True
        self._announce(change)
        return PROBE

    def record(self, ok: bool | None) -> None:
        """One lookup's outcome in the tier: True (its reads answered in time), False (a read
        timed out or raised), None (it read nothing there: only ends a probe grant)."""
        change = None
        with self._lock:
            self._probing = False
            if ok is None:
                return
            if ok:
                self.consecutive = 0
                if self.state != CLOSED:
                    change = self._set(CLOSED)
            else:
                self.consecutive += 1
                if self.state == HALF_OPEN or (
                        self.state == CLOSED and self.consecutive >= self.failures):
                    self._opened_at = self._clock()
                    change = self._set(OPEN)
        self._announce(change)

    def _set(self, new: str) -> tuple[str, str]:
        old, self.state = self.state, new
        return old, new

    def _announce(self, change: tuple[str, str] | None) -> None:
        if change is None:
            return
        old, new = change
        if new == OPEN:
            log.warning("%s: tier %s breaker %s -> open after %d failed lookup(s): skipping it "
                        "for %.1f s", self._owner, self.tier, old, self.consecutive,
                        self.cooldown_s)
        else:
            log.warning("%s: tier %s breaker %s -> %s", self._owner, self.tier, old, new)
        if self._on_change is not None:
            self._on_change(self.tier, old, new)
