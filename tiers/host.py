"""The host tier: byte-capacity memory of chunk objects, owned by one shard process.

A :class:`HostTier` holds two kinds of entries under one LRU/LFU-by-bytes budget
(:class:`tiers.eviction.EvictionIndex`):

* **bytes** (the plain :class:`tiers.tier.Tier` methods): ``put`` keeps a ``bytes`` object
  as is (no copy) and copies any other buffer (bytearray, memoryview, numpy uint8) once, so a
  caller that later reuses its buffer cannot change what is stored. ``get``/``get_ranges``
  return **read-only, zero-copy** memoryviews of the stored bytes.
* **checked on entry**: ``put`` checks a chunk object once as it enters memory (header and
  every layer's XXH3, :func:`tiers.reader.validate_object`; or takes the ``header`` of a
  caller that just did) and keeps the header beside the bytes. Host memory is not re-read
  from a medium, so :func:`tiers.reader.read_layers` then copies layers without hashing them
  again (:meth:`HostTier.get_ranges_verified`). An object that fails the check is stored all
  the same (a byte store; the reader stays the gate) and checked on every read.
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
from tiers.format import ChunkHeader, FormatError
from tiers.keys import ChunkKey
from tiers.reader import validate_object
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
        self._checked: dict[ChunkKey, ChunkHeader] = {}  # bytes entries checked on entry
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
        return self._admit(key, obj, int(nbytes), None)

    def _admit(self, key: ChunkKey, obj: Any, nbytes: int, checked: ChunkHeader | None) -> bool:
        with self._lock:
            if key in self._data:
                return True
            victims = self._index.admit(key, nbytes)
            if victims is None:
                return False
            dropped = [(v, self._pop(v)) for v in victims]
            self._data[key] = obj
            if checked is not None:
                self._checked[key] = checked
            self._stats["puts"] += 1
            self._stats["evictions"] += len(dropped)
            self._stats["bytes_written"] += nbytes
        self._notify(dropped)
        return True

    def _pop(self, key: ChunkKey) -> Any:
        """Drop ``key``'s data (lock held; the index entry is the caller's)."""
        self._checked.pop(key, None)
        return self._data.pop(key)

    def get_object(self, key: ChunkKey) -> Any | None:
        """The stored object (a hit counts as a use for eviction), or None."""
        return self._lookup(key)[0]

    def _lookup(self, key: ChunkKey) -> tuple[Any | None, ChunkHeader | None]:
        """``(object, header it was checked against on entry or None)``; a hit is a use."""
        with self._lock:
            obj = self._data.get(key)
            if obj is None:
                self._stats["misses"] += 1
                return None, None
            self._index.touch(key)
            self._stats["hits"] += 1
            self._stats["bytes_read"] += self._index.nbytes(key) or 0
            return obj, self._checked.get(key)

    def _notify(self, dropped: list[tuple[ChunkKey, Any]]) -> None:
        if self._on_evict is not None:
            for k, o in dropped:
                self._on_evict(k, o)

    # -- Tier ----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def put(self, key: ChunkKey, obj: Buffer, *, header: ChunkHeader | None = None) -> bool:
        """Store an encoded chunk object (``bytes`` kept as is, other buffers copied once),
        checked once here (see module docstring).

        Args:
            header: ``validate_object(obj, key)``'s result when the caller just checked this
                very object (skips a second pass over its bytes); None: checked here.
        """
        with self._lock:
            if key in self._data:  # first wins: no copy, no check
                return True
        data = obj if isinstance(obj, bytes) else memoryview(obj).cast("B").tobytes()
        if header is None:
            try:
                header = validate_object(data, key)
            except FormatError:
                header = None  # stored as given; every read checks it
        return self._admit(key, data, len(data), header)

    def get(self, key: ChunkKey) -> memoryview | None:
        """Read-only zero-copy view of the whole object, or None."""
        return self._view(self.get_object(key))

    def _view(self, obj: Any) -> memoryview | None:
        if obj is None:
            return None
        try:
            return memoryview(obj).cast("B").toreadonly()
        except TypeError:
            with self._lock:
                self._stats["errors"] += 1
            return None

    def get_ranges_verified(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]
                            ) -> tuple[list[memoryview], ChunkHeader | None] | None:
        """:meth:`get_ranges` and, from the same entry, the header its bytes were checked
        against when they entered (None when they were not: an opaque entry, or an object
        that failed the check). A reader may skip the XXH3 of a range that is a layer of that
        header with the entry it expects (same offset, length, codec and checksum).

        Raises:
            ValueError: a negative offset or length.
        """
        for off, length in ranges:
            if off < 0 or length < 0:
                raise ValueError(f"bad range ({off}, {length})")
        obj, checked = self._lookup(key)
        view = self._view(obj)
        if view is None:
            return None
        if any(off + length > view.nbytes for off, length in ranges):
            with self._lock:
                self._stats["errors"] += 1
            return None
        return [view[off:off + length] for off, length in ranges], checked

    def checked_header(self, key: ChunkKey) -> ChunkHeader | None:
        """The header ``key``'s object was checked against when it entered (a hit), or None
        (absent or not checked on entry: nothing counted; read the header from the bytes)."""
        with self._lock:
            checked = self._checked.get(key)
            if checked is not None:
                self._index.touch(key)
                self._stats["hits"] += 1
                self._stats["bytes_read"] += self._index.nbytes(key) or 0
            return checked

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
        got = self.get_ranges_verified(key, ranges)
        return None if got is None else got[0]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        dropped = []
        with self._lock:
            for k in keys:
                if k in self._data:
                    self._index.remove(k)
                    dropped.append((k, self._pop(k)))
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
