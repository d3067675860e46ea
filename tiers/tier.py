"""The ``Tier`` protocol: a byte store of encoded chunk objects, and an in-memory reference.

Tiers are deliberately dumb: they store whole encoded chunk objects (see :mod:`tiers.format`)
under a :class:`~tiers.keys.ChunkKey` and serve byte ranges of them, so that one layer can
be read without the others (disk ``pread``, Redis ``GETRANGE``, S3 ranged GET). Validation
(magic, version, namespace, checksums) and decoding happen in :mod:`tiers.format`, once, for
every tier.

Lifecycle and failure behaviour, common to every tier:
  * ``contains``/``get``/``get_ranges`` never raise for I/O errors, timeouts or a dead
    backend: they return a miss (``False``/``None``) and count it in ``stats()['errors']``.
  * ``put`` is idempotent: the first complete object under a key wins, a later ``put`` of
    the same key returns ``True`` without rewriting. Readers never see a torn object.
  * Reading never changes the stored bytes; callers that modify data work on their copy.
  * Caller mistakes (wrong types, negative ranges) raise ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tiers.keys import ChunkKey

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class Tier(Protocol):
    """A batch-first byte store of chunk objects (see module docstring for failure rules)."""

    name: str

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Which keys are stored (one round trip for the batch)."""
        ...

    def get(self, key: ChunkKey) -> Buffer | None:
        """The whole object, or None on a miss or an error."""
        ...

    def get_ranges(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]) -> list[Buffer] | None:
        """Byte ranges ``(offset, length)`` of one object, or None on a miss or an error
        (including a range past the end)."""
        ...

    def put(self, key: ChunkKey, obj: Buffer) -> bool:
        """Store ``obj`` under ``key`` (idempotent). False when it could not be stored
        (full after eviction, backend down, over a size limit)."""
        ...

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove keys; returns how many were present."""
        ...

    def stats(self) -> dict[str, float]:
        """Counters: hits, misses, errors, puts, evictions, bytes_used, capacity_bytes,
        bytes_read, bytes_written, num_chunks."""
        ...


class MemoryTier:
    """Reference :class:`Tier`: an LRU dict of bytes bounded by ``capacity_bytes``.

    Used by tests and as the contract's executable definition. Thread-safe.
    """

    def __init__(self, capacity_bytes: int, name: str = "memory") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes} must be >= 0")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._data: OrderedDict[ChunkKey, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(
            ("hits", "misses", "errors", "puts", "evictions", "bytes_read", "bytes_written"), 0)

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def get(self, key: ChunkKey) -> bytes | None:
        with self._lock:
            obj = self._data.get(key)
            if obj is None:
                self._stats["misses"] += 1
                return None
            self._data.move_to_end(key)
            self._stats["hits"] += 1
            self._stats["bytes_read"] += len(obj)
            return obj

    def get_ranges(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]) -> list[memoryview] | None:
        obj = self.get(key)
        if obj is None:
            return None
        view = memoryview(obj)
        out = []
        for off, length in ranges:
            if off < 0 or length < 0:
                raise ValueError(f"bad range ({off}, {length})")
            if off + length > len(obj):
                with self._lock:
                    self._stats["errors"] += 1
                return None
            out.append(view[off:off + length])
        return out

    def put(self, key: ChunkKey, obj: Buffer) -> bool:
        data = bytes(obj)
        with self._lock:
            if key in self._data:
                return True
            if len(data) > self.capacity_bytes:
                return False
            while self._used + len(data) > self.capacity_bytes:
                _, old = self._data.popitem(last=False)
                self._used -= len(old)
                self._stats["evictions"] += 1
            self._data[key] = data
            self._used += len(data)
            self._stats["puts"] += 1
            self._stats["bytes_written"] += len(data)
            return True

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                obj = self._data.pop(k, None)
                if obj is not None:
                    self._used -= len(obj)
                    n += 1
        return n

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._stats, "bytes_used": self._used, "capacity_bytes": self.capacity_bytes,
                    "num_chunks": len(self._data)}
