"""Eviction bookkeeping by bytes (LRU or LFU) with pins, shared by the host, disk and gpu tiers.

No torch and no data here: an :class:`EvictionIndex` tracks ``key -> nbytes``, an access
order and pin counts, and answers "which keys must go so that ``nbytes`` more fit?". The
tier that owns the index holds the data, takes its own lock around every call (the index is
not thread-safe by itself) and drops the victims the index names.

Policies:
  * ``lru`` — evict the least recently used key first (a put or a hit is a use).
  * ``lfu`` — evict the key with the fewest uses first (a put counts 1, each hit +1); ties go
    to the least recently used (so an LFU index with all counts equal behaves as LRU).

Pins: a pinned key (pin count > 0) is never chosen as a victim. :meth:`admit` either frees
enough room from unpinned keys, or changes nothing and returns ``None``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator

POLICIES = ("lru", "lfu")


class EvictionIndex:
    """Byte-capacity index of keys with LRU/LFU order and pins.

    Args:
        capacity_bytes: the most bytes the admitted keys may hold together (>= 0).
        policy: ``"lru"`` or ``"lfu"``.

    Raises:
        ValueError: negative capacity or an unknown policy.
    """

    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose one of {POLICIES}")
        self.capacity_bytes = int(capacity_bytes)
        self.policy = policy
        self.used_bytes = 0
        self._sizes: OrderedDict[Hashable, int] = OrderedDict()  # LRU order: oldest first
        self._counts: dict[Hashable, int] = {}
        self._ticks: dict[Hashable, int] = {}
        self._heap: list[tuple[int, int, int, Hashable]] = []  # (count, tick, seq, key), lazy
        self._clock = itertools.count()
        self._pins: dict[Hashable, int] = {}

    # -- queries -------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[Hashable]:
        return list(self._sizes)

    def nbytes(self, key: Hashable) -> int | None:
        return self._sizes.get(key)

    def is_pinned(self, key: Hashable) -> bool:
        return self._pins.get(key, 0) > 0

    # -- updates -------------------------------------------------------------------------
    def _stamp(self, key: Hashable) -> None:
        tick = next(self._clock)
        self._ticks[key] = tick
        if self.policy == "lfu":
            heapq.heappush(self._heap, (self._counts[key], tick, tick, key))
            if len(self._heap) > 4 * len(self._sizes) + 64:  # drop stale entries now and then
                self._heap = [(self._counts[k], self._ticks[k], self._ticks[k], k) for k in self._sizes]
                heapq.heapify(self._heap)

    def touch(self, key: Hashable) -> None:
        """Record one use of ``key`` (a hit). Unknown keys are ignored."""
        if key not in self._sizes:
            return
        self._sizes.move_to_end(key)
        self._counts[key] += 1
        self._stamp(key)

    def _pop_live(self, taken: list) -> Iterator[Hashable]:
        """LFU keys in (count, tick) order, popped off the heap: stale entries are dropped for
        good (each was pushed once), live ones are appended to ``taken`` for the caller to
        push back. O(log n) per entry, never a copy of the heap."""
        heap = self._heap
        while heap:
            entry = heapq.heappop(heap)
            count, tick, _seq, key = entry
            if key in self._sizes and self._counts[key] == count and self._ticks[key] == tick:
                taken.append(entry)
                yield key

    def plan(self, nbytes: int) -> list[Hashable] | None:
        """Victims (in eviction order) that make ``nbytes`` more fit, or None when even
        evicting every unpinned key would not. Changes nothing (the LFU heap only loses
        stale entries). O(1) when it fits; else O(victims + pinned keys passed over) steps,
        each O(log n) for LFU (plus stale heap entries, paid for by the pushes that made them)."""
        if nbytes > self.capacity_bytes:
            return None
        need = self.used_bytes + nbytes - self.capacity_bytes
        if need <= 0:
            return []
        if self.policy == "lru":
            return self._take(iter(self._sizes), need)
        taken: list[tuple[int, int, int, Hashable]] = []
        try:
            return self._take(self._pop_live(taken), need)
        finally:
            for entry in taken:
                heapq.heappush(self._heap, entry)

    def _take(self, order: Iterator[Hashable], need: int) -> list[Hashable] | None:
        """The first unpinned keys of ``order`` holding at least ``need`` (> 0) bytes."""
        victims: list[Hashable] = []
        for key in order:
            if self._pins.get(key, 0) > 0:
                continue
            victims.append(key)
            need -= self._sizes[key]
            if need <= 0:
                return victims
        return None

    def admit(self, key: Hashable, nbytes: int) -> list[Hashable] | None:
        """Add ``key`` of ``nbytes``, removing victims first.

        Returns:
            The evicted keys (already removed from the index; the caller drops their data),
            ``[]`` when it fit or ``key`` was already present (then it is only touched), or
            None when it cannot fit without evicting pinned keys (nothing changed).

        Raises:
            ValueError: negative ``nbytes``.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if key in self._sizes:
            self.touch(key)
            return []
        victims = self.plan(nbytes)
        if victims is None:
            return None
        for v in victims:
            self.remove(v)
        self._sizes[key] = nbytes
        self._counts[key] = 1
        self.used_bytes += nbytes
        self._stamp(key)
        return victims

    def remove(self, key: Hashable) -> int | None:
        """Forget ``key`` (pins on it stay until unpinned). Returns its nbytes or None."""
        n = self._sizes.pop(key, None)
        if n is None:
            return None
        self.used_bytes -= n
        self._counts.pop(key, None)
        self._ticks.pop(key, None)
        return n

    def pin(self, key: Hashable) -> bool:
        """Pin ``key`` once (pins nest). False (and no pin) when the key is not present."""
        if key not in self._sizes:
            return False
        self._pins[key] = self._pins.get(key, 0) + 1
        return True

    def unpin(self, key: Hashable) -> None:
        """Undo one :meth:`pin`. Unpinning an unpinned key is a no-op."""
        n = self._pins.get(key, 0)
        if n <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = n - 1
