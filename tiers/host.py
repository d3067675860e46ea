"""The host tier: byte-capacity memory of chunk objects, owned by one shard process.

A :class:`HostTier` holds two kinds of entries under one LRU/LFU-by-bytes budget
(:class:`tiers.eviction.EvictionIndex`):

* **bytes** (the plain :class:`tiers.tier.Tier` methods): ``put`` keeps a ``bytes`` object
  as is (no copy) and copies any other buffer (bytearray, memoryview, numpy uint8) once, so a
  caller that later reuses its buffer cannot change what is stored. ``get``/``get_ranges``
  return **read-only, zero-copy** memoryviews of the stored bytes.
* **opaque objects** (``put_object``/``get_object``): e.g. the Ray shard stores a Ray
  ``ObjectRef`` of the chunk's numpy buffer (Ray's object store holds the bytes; readers on
  the node get them zero-copy). The tier accounts ``nbytes`` for it, evicts it like any
  entry and calls ``on_evict(key, obj)`` when it drops it, so the owner can release the
  ref. Our eviction, not Ray's spilling, decides what stays. Byte reads (``get``) of an
  opaque entry work when the object exposes the buffer protocol (numpy arrays do); an
  ``ObjectRef`` does not, and reads as a miss there (use ``get_object``).

Pins: ``pin(keys)``/``unpin(keys)`` (nested counts). A pinned chunk is never evicted; a put
that cannot fit without evicting pinned chunks returns False and stores nothing.

Failure behaviour: memory has no timeouts or I/O errors; a miss is ``None``/``False`` and
counted in ``stats()['misses']``; a byte read of a non-buffer entry counts ``errors``.
Thread-safe (one lock; ``on_evict`` runs outside it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from tiers.eviction import EvictionIndex
from tiers.keys import ChunkKey
from tiers.tier import Buffer

_COUNTERS = ("hits", "misses", "errors", "puts", "evictions", "bytes_read", "bytes_written")


class HostTier:
    """Byte-capacity memory tier (see module docstring).

    Args:
        capacity_bytes: most bytes held (the sum of stored objects' sizes / declared nbytes).
        policy: ``"lru"`` or ``"lfu"`` eviction.
        on_evict: called as ``on_evict(key, obj)`` after an entry is evicted or deleted.
        name: tier name in stats and logs.

    Raises:
        ValueError: negative capacity or unknown policy.
    """

    def __init__(self, capacity_bytes: int, policy: str = "lru",
                 on_evict: Callable[[ChunkKey, Any], None] | None = None,
                 name: str = "host") -> None:
        self.name = name
        self._index = EvictionIndex(capacity_bytes, policy)
        self._data: dict[ChunkKey, Any] = {}
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_COUNTERS, 0)

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    # -- opaque objects ------------------------------------------------------------------
    def put_object(self, key: ChunkKey, obj: Any, nbytes: int) -> bool:
        """Store an opaque handle accounted as ``nbytes``. Idempotent (first wins: a second
        put of a present key returns True and keeps the first object; the new ``obj`` is
        not passed to ``on_evict``). False when it cannot fit without evicting pinned keys.

        Raises:
            ValueError: negative ``nbytes``.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        with self._lock:
            if key in self._data:
                return True
            victims = self._index.admit(key, int(nbytes))
            if victims is None:
                return False
            dropped = [(v, self._data.pop(v)) for v in victims]
            self._data[key] = obj
            self._stats["puts"] += 1
            self._stats["evictions"] += len(dropped)
            self._stats["bytes_written"] += int(nbytes)
        self._notify(dropped)
        return True

    def get_object(self, key: ChunkKey) -> Any | None:
        """The stored object (a hit counts as a use for eviction), or None."""
        with self._lock:
            obj = self._data.get(key)
            if obj is None:
                self._stats["misses"] += 1
                return None
            self._index.touch(key)
            self._stats["hits"] += 1
            self._stats["bytes_read"] += self._index.nbytes(key) or 0
            return obj

    def _notify(self, dropped: list[tuple[ChunkKey, Any]]) -> None:
        if self._on_evict is not None:
            for k, o in dropped:
                self._on_evict(k, o)

    # -- Tier ----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def put(self, key: ChunkKey, obj: Buffer) -> bool:
        """Store an encoded chunk object (``bytes`` kept as is, other buffers copied once)."""
        data = obj if isinstance(obj, bytes) else memoryview(obj).cast("B").tobytes()
        return self.put_object(key, data, len(data))

    def get(self, key: ChunkKey) -> memoryview | None:
        """Read-only zero-copy view of the whole object, or None."""
        obj = self.get_object(key)
        if obj is None:
            return None
        try:
            return memoryview(obj).cast("B").toreadonly()
        except TypeError:
            with self._lock:
                self._stats["errors"] += 1
            return None

    def head(self, key: ChunkKey, max_bytes: int) -> memoryview | None:
        """The first ``min(max_bytes, size)`` bytes of the object, or None."""
        view = self.get(key)
        return None if view is None else view[:max_bytes]

    def get_ranges(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]) -> list[memoryview] | None:
        """Zero-copy read-only views of ``(offset, length)`` ranges, or None (a miss, or a
        range past the end, counted in ``errors``).

        Raises:
            ValueError: a negative offset or length.
        """
        for off, length in ranges:
            if off < 0 or length < 0:
                raise ValueError(f"bad range ({off}, {length})")
        view = self.get(key)
        if view is None:
            return None
        if any(off + length > view.nbytes for off, length in ranges):
            with self._lock:
                self._stats["errors"] += 1
            return None
        return [view[off:off + length] for off, length in ranges]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        dropped = []
        with self._lock:
            for k in keys:
                if k in self._data:
                    self._index.remove(k)
                    dropped.append((k, self._data.pop(k)))
        self._notify(dropped)
        return len(dropped)

    # -- pins ----------------------------------------------------------------------------
    def pin(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Pin present keys (nested); returns which were present (and are now pinned)."""
        with self._lock:
            return [self._index.pin(k) for k in keys]

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Undo one pin of each key."""
        with self._lock:
            for k in keys:
                self._index.unpin(k)

    def keys(self) -> list[ChunkKey]:
        """Stored keys, next victim first under LRU."""
        with self._lock:
            return self._index.keys()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._stats, "bytes_used": self._index.used_bytes,
                    "capacity_bytes": self._index.capacity_bytes, "num_chunks": len(self._data)}
