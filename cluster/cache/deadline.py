"""``LowerLookup``: the shard's lookup below host memory, answered by a deadline (issue #20).

For the keys of one lookup call that host memory lacks, one task per key (on a small pool
owned by the shard, all keys in parallel) walks the lower tiers top to bottom and reads each
tier's header once (:func:`read_header_bytes`: the bytes read are both parsed and returned).
The call waits until ``lookup_timeout_s`` after its start: a key not answered by then is a miss
(counted ``lookup_timeouts``, and the metric ``kvblend_lookup_timeouts``); its read may go on in
the background, but nothing waits for it. A tier keeps at most :data:`TIER_READS` reads in
flight (a tier that blocks holds at most that many threads), and a
:class:`~cluster.cache.breaker.TierBreaker` per tier stops reading a tier whose reads keep
missing the deadline (counters ``breaker_open``, ``breaker_half_open``, ``breaker_closed``;
one log line per change; metrics ``kvblend_breaker_transitions`` per change and the gauge
``kvblend_breaker_open``: 0 from the breaker's creation, 1 while open or half-open).

Failure behaviour: never raises for a tier fault — an exception from a tier, a corrupt header
(``read_errors``) or a late read is a miss in that tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from cluster.cache.breaker import (
    ALL,
    BREAKER_COOLDOWN_S,
    BREAKER_FAILURES,
    CLOSED,
    PROBE,
    TierBreaker,
)
from cluster.cache.metrics import ShardMetrics
from tiers.config import TiersConfig
from tiers.format import HEADER_PROBE_BYTES, PREFIX_BYTES, FormatError, parse_header, parse_prefix
from tiers.keys import ChunkKey

log = logging.getLogger("kvblend.shard")

#: header reads in flight per tier (a blocked tier holds at most this many pool threads)
TIER_READS = 8
#: pool threads: room for three blocked tiers and the reads of the healthy ones
LOOKUP_THREADS = 32
#: seconds a client waits for the shards' lookup answers beyond ``lookup_timeout_s`` (the Ray
#: round trip and the actor's queue); a shard later than that is a miss for its keys
LOOKUP_MARGIN_S = 0.25
#: a key's answer when the deadline came first
_LATE = object()


def lookup_wait_s(config) -> float:
    """How long a client waits for lookup answers: ``config.tiers.lookup_timeout_s`` (its
    default without one) + :data:`LOOKUP_MARGIN_S`."""
    tiers = getattr(config, "tiers", None)
    return getattr(tiers, "lookup_timeout_s", TiersConfig.lookup_timeout_s) + LOOKUP_MARGIN_S


def read_header_bytes(tier, key: ChunkKey) -> bytes | None:
    """The prefix + header bytes of ``key``'s object in ``tier``, validated as ``key``'s
    (one read; a header longer than :data:`~tiers.format.HEADER_PROBE_BYTES` costs one more);
    None when absent. Raises :class:`~tiers.format.FormatError` for a corrupt header."""
    head = getattr(tier, "head", None)
    if head is not None:
        buf = head(key, HEADER_PROBE_BYTES)
    else:
        got = tier.get_ranges(key, [(0, HEADER_PROBE_BYTES)])
        buf = got[0] if got is not None else tier.get(key)  # shorter than the probe
    if not buf:
        return None
    try:
        header = parse_header(buf, expected_key=key)
    except FormatError as e:
        if "truncated header" not in str(e) or len(buf) < HEADER_PROBE_BYTES:
            raise
        got = tier.get_ranges(key, [(0, PREFIX_BYTES + parse_prefix(buf))])
        if got is None:
            return None
        buf = got[0]
        header = parse_header(buf, expected_key=key)
    return bytes(memoryview(buf)[:header.header_end])


class _Call:
    """One lookup call's plan (what each tier's breaker allows) and per-tier outcome."""

    def __init__(self, deadline: float, plan: dict[str, str]) -> None:
        self.deadline = deadline
        self.plan = plan
        self.lock = threading.Lock()
        self.closed = False
        self.probe_taken: set[str] = set()
        self.inflight = dict.fromkeys(plan, 0)
        self.answered = dict.fromkeys(plan, 0)
        self.failed = dict.fromkeys(plan, 0)

    def may_read(self, tier: str) -> bool:
        mode = self.plan.get(tier)
        if mode == ALL:
            return True
        if mode != PROBE:
            return False
        with self.lock:
            if tier in self.probe_taken:
                return False
            self.probe_taken.add(tier)
            return True

    def note(self, tier: str, what: str, n: int = 1) -> None:
        with self.lock:
            if not self.closed:
                getattr(self, what)[tier] += n

    def close(self) -> dict[str, bool | None]:
        """Ends the call; per planned tier: False (a read late or failed), True (reads
        answered), None (nothing read there)."""
        with self.lock:
            self.closed = True
            return {t: (False if self.failed[t] or self.inflight[t] else
                        True if self.answered[t] else None) for t in self.plan}


class LowerLookup:
    """Deadline-bound header lookups in the lower tiers, with a breaker per tier.

    Args:
        timeout_s: the deadline of one call (``lookup_timeout_s``), from the call's start.
        count: ``count(counter_name, n)`` — the shard's counters.
        owner: the shard's name (log lines).
        failures, cooldown_s: of each tier's :class:`~cluster.cache.breaker.TierBreaker`.
        metrics: the shard's :class:`~cluster.cache.metrics.ShardMetrics` (None: none).
    """

    def __init__(self, timeout_s: float, count: Callable[..., None], owner: str = "",
                 failures: int = BREAKER_FAILURES, cooldown_s: float = BREAKER_COOLDOWN_S,
                 metrics: ShardMetrics | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._count = count
        self._owner = owner
        self._metrics = metrics if metrics is not None else ShardMetrics(owner, enabled=False)
        self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvblend-shard-lookup")
        self._lock = threading.Lock()
        self.breakers: dict[str, TierBreaker] = {}
        self._slots: dict[str, threading.BoundedSemaphore] = {}

    def breaker(self, tier: str) -> TierBreaker:
        with self._lock:
            b = self.breakers.get(tier)
            if b is not None:
                return b
            b = self.breakers[tier] = TierBreaker(
                tier, self.failures, self.cooldown_s, self._changed, self._owner)
            self._slots[tier] = threading.BoundedSemaphore(TIER_READS)
            # a series from the start; under the lock: before any change can set it
            self._metrics.set("kvblend_breaker_open", 0, tier)
            return b

    def _changed(self, tier: str, old: str, new: str) -> None:
        self._count(f"breaker_{new}")
        self._metrics.inc("kvblend_breaker_transitions", 1, tier, state=new)
        self._metrics.set("kvblend_breaker_open", 0 if new == CLOSED else 1, tier)

    def find(self, tiers: Sequence, keys: Sequence[ChunkKey], started: float) -> list[tuple | None]:
        """Per key ``(tier name, header bytes)`` of the first tier holding it, or None (absent,
        skipped or not answered by ``started + timeout_s``, ``started`` from
        ``time.monotonic()``). Returns by then (plus scheduling slack) whatever the tiers do."""
        if not keys:
            return []
        plan = {}
        for tier in tiers:
            mode = self.breaker(tier.name).allow()
            if mode is not None:
                plan[tier.name] = mode
        if not plan:  # every tier's breaker is open: all misses, nothing read
            return [None] * len(keys)
        call = _Call(started + self.timeout_s, plan)
        futs = [self._pool.submit(self._one, tiers, key, call) for key in keys]
        _, late = wait_futures(futs, timeout=max(0.0, call.deadline - time.monotonic()))
        for f in late:
            f.cancel()  # still queued: never starts
        for name, ok in call.close().items():
            self.breakers[name].record(ok)
        out: list[tuple | None] = []
        timeouts = 0
        for f in futs:
            res = f.result() if f not in late else _LATE
            if res is _LATE:
                timeouts += 1
                res = None
            out.append(res)
        if timeouts:
            self._count("lookup_timeouts", timeouts)
            self._metrics.inc("kvblend_lookup_timeouts", timeouts)
        return out

    def _one(self, tiers: Sequence, key: ChunkKey, call: _Call):
        """One key's walk down the tiers; ``_LATE`` when the deadline came first."""
        for tier in tiers:
            name = tier.name
            if not call.may_read(name):
                continue
            remaining = call.deadline - time.monotonic()
            if remaining <= 0:
                return _LATE
            slots = self._slots[name]
            if not slots.acquire(timeout=remaining):  # the tier's reads are all stuck
                call.note(name, "failed")
                return _LATE
            call.note(name, "inflight")
            try:
                got = read_header_bytes(tier, key)
            except FormatError as e:
                log.debug("%s: %s holds a corrupt header for %s: %s", self._owner, name, key, e)
                self._count("read_errors")
                got = None
            except Exception as e:  # noqa: BLE001 - a tier fault: a miss there
                log.debug("%s: header read of %s in %s failed: %r", self._owner, key, name, e)
                call.note(name, "failed")
                got = None
            finally:
                slots.release()
                call.note(name, "inflight", -1)
            call.note(name, "answered")
            if got is not None:
                return name, got
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
