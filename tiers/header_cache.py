"""The headers a :class:`tiers.stack.TierStack` last read, per tier and key.

A cached header lets a layer read skip the probe; a header that no longer matches the object
under its key (re-encoded meanwhile) fails the checks and is read again by the stack. Bounded
(least recently used first out) and thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from tiers.format import ChunkHeader
from tiers.keys import ChunkKey


class HeaderCache:
    """At most ``capacity`` headers keyed by ``(tier name, key)``."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._headers: OrderedDict[tuple[str, ChunkKey], ChunkHeader] = OrderedDict()

    def get(self, tier: str, key: ChunkKey) -> ChunkHeader | None:
        with self._lock:
            h = self._headers.get((tier, key))
            if h is not None:
                self._headers.move_to_end((tier, key))
            return h

    def put(self, tier: str, key: ChunkKey, header: ChunkHeader | None) -> None:
        """Remember ``header`` (None: forget the entry)."""
        with self._lock:
            if header is None:
                self._headers.pop((tier, key), None)
                return
            self._headers[(tier, key)] = header
            while len(self._headers) > self.capacity:
                self._headers.popitem(last=False)

    def forget(self, tiers: Iterable[str], keys: Iterable[ChunkKey]) -> None:
        keys = list(keys)
        with self._lock:
            for entry in [(t, k) for t in tiers for k in keys]:
                self._headers.pop(entry, None)
