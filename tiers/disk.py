"""The disk tier: one file per chunk object under a directory, with a byte capacity.

Layout: ``<path>/<content[:2]>/<namespace>.<kind>.<content>.kvbc`` (256-way fan-out by the
content hash so no directory grows huge). File names carry the whole key, so the index is
rebuilt from a directory scan at start-up: a restart loses nothing (recency order is
restored from file mtimes; LFU counts restart at 1).

Writes are atomic and first-wins: the object goes to a unique temporary file in the target
directory, is ``fsync``-ed, then hard-linked to its final name (``os.link`` fails if the
name exists, so the first complete object wins even across processes) and the directory is
fsync-ed. A reader opens a final name only, which always holds a complete object; an
evicted file stays readable through descriptors already open. Reads use ``os.pread`` /
``os.preadv`` (straight into the caller's buffer with :meth:`DiskTier.get_ranges_into`;
:meth:`DiskTier.get_ranges_into_each` hands each range to the reader's check as it lands).

Failure behaviour: local file I/O is synchronous, in the caller's thread. Any ``OSError`` (a
vanished file, EIO, ENOSPC, permissions) is a miss / a failed put (``False``), logged at
debug level and counted in ``stats()['errors']``; nothing raises to the caller except
caller mistakes (``ValueError``). With ``io_timeout_s``, a call that runs longer makes the
tier *stalled* (:class:`tiers.io_watch.IoWatch`): new calls are misses / failed puts at once
(``io_refused``) until it returns (``io_timeouts``), so no thread queues behind a hung
device. Thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from tiers.eviction import EvictionIndex
from tiers.io_watch import IoWatch
from tiers.keys import ChunkKey
from tiers.tier import Buffer

log = logging.getLogger(__name__)

_SUFFIX = ".kvbc"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0
_COUNTERS = ("hits", "misses", "errors", "puts", "evictions", "bytes_read", "bytes_written")


class DiskTier:
    """Files of chunk objects under ``path`` (see module docstring).

    Args:
        path: directory (created if missing).
        capacity_bytes: most bytes of object files kept; LRU/LFU eviction beyond it.
        policy: ``"lru"`` or ``"lfu"``.
        fsync: fsync each file and its directory on put (durable across power loss); turn
            off only for throwaway caches.
        name: tier name in stats.
        shared: other processes write into the same directory (a machine-local cache shared
            by a vLLM engine's scheduler and worker processes): a key missing from this
            process's index is looked up on disk and adopted when its file exists. Eviction
            stays per process; a file removed by another process is a miss.
        io_timeout_s: seconds one read or write may run before the tier counts as stalled
            and refuses new calls until it returns (see module docstring); None: no deadline.

    Raises:
        ValueError: negative capacity or unknown policy.
        OSError: ``path`` cannot be created or listed (start-up only).
    """

    def __init__(self, path: str, capacity_bytes: int, policy: str = "lru", *,
                 fsync: bool = True, name: str = "disk", shared: bool = False,
                 io_timeout_s: float | None = None) -> None:
        self.name = name
        self.shared = shared
        self.path = os.path.abspath(path)
        self.fsync = fsync
        self._index = EvictionIndex(capacity_bytes, policy)
        self._pending: set[ChunkKey] = set()
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._watch = IoWatch(io_timeout_s, name)
        os.makedirs(self.path, exist_ok=True)
        self._rebuild()

    # -- paths and index -------------------------------------------------------------------
    def _file(self, key: ChunkKey) -> str:
        return os.path.join(self.path, key.content[:2], f"{key.namespace}.{key.kind}.{key.content}{_SUFFIX}")

    def _rebuild(self) -> None:
        """Index the object files already under ``path`` (a restarted shard's). Names are
        checked here; contents when read (the readers validate every object: a bad one is a
        miss and the stack deletes it), so opening a large directory reads no object."""
        found: list[tuple[float, ChunkKey, int, str]] = []
        now = time.time()
        for sub in os.scandir(self.path):
            if not sub.is_dir():
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError as e:  # an unreadable sub-directory: its chunks are misses
                log.warning("disk tier %s: cannot list %s: %s", self.path, sub.path, e)
                continue
            for ent in entries:
                try:
                    st = ent.stat()
                except OSError:
                    continue
                if ent.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_S:  # left by a crashed writer
                        _unlink(ent.path)
                    continue
                if not ent.name.endswith(_SUFFIX):
                    continue
                parts = ent.name[:-len(_SUFFIX)].split(".")
                try:
                    key = ChunkKey(*parts) if len(parts) == 3 else None
                except ValueError:
                    key = None
                if key is None or self._file(key) != ent.path:
                    log.warning("disk tier %s: ignoring foreign file %s", self.path, ent.path)
                    continue
                found.append((st.st_mtime, key, st.st_size, ent.path))
        found.sort(key=lambda t: t[0])  # oldest first = first LRU victim
        for _mtime, key, size, path in found:
            victims = self._index.admit(key, size)
            if victims is None:  # over capacity (capacity shrank since last run)
                _unlink(path)
                continue
            for v in victims:
                _unlink(self._file(v))
                self._stats["evictions"] += 1
        log.info("disk tier %s: %d chunks, %d bytes after rebuild", self.path,
                 len(self._index), self._index.used_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    def _ready(self, key: ChunkKey) -> bool:
        if key in self._index:
            return key not in self._pending
        return self.shared and self._adopt(key)

    def _adopt(self, key: ChunkKey) -> bool:
        """Index a file that another process wrote since our rebuild (``shared``; lock held)."""
        try:
            size = os.stat(self._file(key)).st_size
        except OSError:
            return False
        victims = self._index.admit(key, size)
        if victims is None:
            return False
        for v in victims:
            _unlink(self._file(v))
            self._stats["evictions"] += 1
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    # -- Tier ----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [self._ready(k) for k in keys]

    def _watched(self, fn: Callable, refused, *args):
        """``fn(*args)`` as one watched call, or ``refused`` while the tier is stalled."""
        token = self._watch.begin()
        if token is None:
            return refused
        try:
            return fn(*args)
        finally:
            self._watch.end(token)

    def put(self, key: ChunkKey, obj: Buffer) -> bool:
        """Write ``obj`` atomically (first wins). False when it cannot fit without evicting
        pinned chunks, on an I/O error (counted) or while the tier is stalled."""
        return self._watched(self._put, False, key, obj)

    def _put(self, key: ChunkKey, obj: Buffer) -> bool:
        view = memoryview(obj).cast("B")
        nbytes = view.nbytes
        with self._lock:
            if key in self._index:
                return True
            victims = self._index.admit(key, nbytes)
            if victims is None:
                return False
            self._index.pin(key)  # a concurrent put must not evict a half-written file
            self._pending.add(key)
            for v in victims:
                _unlink(self._file(v))
            self._stats["evictions"] += len(victims)
        final = self._file(key)
        tmp = os.path.join(os.path.dirname(final), f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        ok = False
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                written = 0
                while written < nbytes:
                    written += os.write(fd, view[written:])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, final)
            except FileExistsError:
                # Another process stored the complete object first (same key, same KV; its
                # size may differ if it chose other codecs: accounted at ours until restart).
                pass
            if self.fsync:
                _fsync_dir(os.path.dirname(final))
            ok = True
        except OSError as e:
            log.debug("disk tier put %s failed: %s", key, e)
        finally:
            _unlink(tmp)
        with self._lock:
            self._pending.discard(key)
            self._index.unpin(key)
            if ok:
                self._stats["puts"] += 1
                self._stats["bytes_written"] += nbytes
            else:
                self._index.remove(key)
                self._stats["errors"] += 1
        return ok

    def _open(self, key: ChunkKey) -> int | None:
        with self._lock:
            if not self._ready(key):
                self._stats["misses"] += 1
                return None
            self._index.touch(key)
        try:
            return os.open(self._file(key), os.O_RDONLY)
        except OSError as e:
            log.debug("disk tier open %s failed: %s", key, e)
            with self._lock:
                self._stats["errors"] += 1
                if isinstance(e, FileNotFoundError):  # removed behind our back
                    self._index.remove(key)
            return None

    def get(self, key: ChunkKey) -> bytes | None:
        """The whole object (one read), or None."""
        return self._watched(self._get, None, key)

    def _get(self, key: ChunkKey) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0)
            if len(data) != size:
                raise OSError(f"short read {len(data)}/{size}")
        except OSError as e:
            log.debug("disk tier read %s failed: %s", key, e)
            self._count("errors")
            return None
        finally:
            os.close(fd)
        with self._lock:
            self._stats["hits"] += 1
            self._stats["bytes_read"] += size
        return data

    def head(self, key: ChunkKey, max_bytes: int) -> bytes | None:
        """The first ``min(max_bytes, size)`` bytes, or None."""
        return self._watched(self._head, None, key, max_bytes)

    def _head(self, key: ChunkKey, max_bytes: int) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            data = os.pread(fd, max_bytes, 0)
        except OSError:
            self._count("errors")
            return None
        finally:
            os.close(fd)
        self._count("bytes_read", len(data))
        return data

    def get_ranges(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]) -> list[bytearray] | None:
        """Bytes of each ``(offset, length)``, or None (a miss; a range past the end or an
        I/O error counts ``errors``).

        Raises:
            ValueError: a negative offset or length.
        """
        bufs = [bytearray(length) for _off, length in _checked(ranges)]
        if not self.get_ranges_into(key, ranges, bufs):
            return None
        return bufs  # bytearrays: the caller's own copy

    def get_ranges_into(self, key: ChunkKey, ranges: Sequence[tuple[int, int]],
                        outs: Sequence[Buffer]) -> bool:
        """Read each ``(offset, length)`` straight into the matching writable buffer
        (``os.preadv``, one call per run of adjacent ranges). False on a miss, a range past
        the end or an I/O error (counted); the buffers' contents are then unspecified.

        Raises:
            ValueError: bad ranges or a buffer of the wrong size.
        """
        return self._read_into(key, ranges, outs, None)

    def get_ranges_into_each(self, key: ChunkKey, ranges: Sequence[tuple[int, int]],
                             outs: Sequence[Buffer], each: Callable[[int], None]) -> bool:
        """:meth:`get_ranges_into` one range at a time, in order, calling ``each(i)`` as soon
        as range ``i`` is in ``outs[i]`` (before the next read, while its bytes are still in
        the CPU's cache: the reader checks a layer there, and may reuse one buffer for
        several ranges). An exception from ``each`` stops the read and propagates.

        Raises:
            ValueError: bad ranges or a buffer of the wrong size.
        """
        return self._read_into(key, ranges, outs, each)

    def _read_into(self, key: ChunkKey, ranges: Sequence[tuple[int, int]],
                   outs: Sequence[Buffer], each: Callable[[int], None] | None) -> bool:
        views = [memoryview(o).cast("B") for o in outs]
        if len(views) != len(ranges):
            raise ValueError(f"{len(ranges)} ranges but {len(views)} buffers")
        for (_off, length), v in zip(_checked(ranges), views, strict=False):
            if v.nbytes != length:
                raise ValueError(f"buffer of {v.nbytes} bytes for a range of {length}")
        return self._watched(self._read_views, False, key, ranges, views, each)

    def _read_views(self, key: ChunkKey, ranges: Sequence[tuple[int, int]],
                    views: Sequence[memoryview], each: Callable[[int], None] | None) -> bool:
        fd = self._open(key)
        if fd is None:
            return False
        total = 0
        try:
            i = 0
            while i < len(ranges):
                j, end = i + 1, ranges[i][0] + ranges[i][1]
                while each is None and j < len(ranges) and ranges[j][0] == end:
                    end += ranges[j][1]
                    j += 1
                want = end - ranges[i][0]
                got = os.preadv(fd, views[i:j], ranges[i][0])
                if got != want:
                    raise OSError(f"short read {got}/{want} (range past the end?)")
                total += got
                if each is not None:
                    each(i)
                i = j
        except OSError as e:
            log.debug("disk tier read %s failed: %s", key, e)
            self._count("errors")
            return False
        finally:
            os.close(fd)
        with self._lock:
            self._stats["hits"] += 1
            self._stats["bytes_read"] += total
        return True

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                if k in self._index and k not in self._pending:
                    self._index.remove(k)
                    _unlink(self._file(k))
                    n += 1
        return n

    def pin(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Pin present keys against eviction (nested); returns which were present."""
        with self._lock:
            return [self._ready(k) and self._index.pin(k) for k in keys]

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        with self._lock:
            for k in keys:
                self._index.unpin(k)

    def keys(self) -> list[ChunkKey]:
        """Stored keys, next victim first under LRU."""
        with self._lock:
            return [k for k in self._index.keys() if k not in self._pending]

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._stats, **self._watch.stats(), "bytes_used": self._index.used_bytes,
                    "capacity_bytes": self._index.capacity_bytes, "num_chunks": len(self._index)}


def _checked(ranges: Sequence[tuple[int, int]]) -> Sequence[tuple[int, int]]:
    for off, length in ranges:
        if off < 0 or length < 0:
            raise ValueError(f"bad range ({off}, {length})")
    return ranges


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.debug("unlink %s failed: %s", path, e)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
