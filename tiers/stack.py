"""A stack of byte tiers (host, disk, Redis, S3): read through, promote up, write down.

Lifecycle, for the shard that owns a stack::

    stack = TierStack([host, disk, redis, s3], write_down=("disk", "redis"), compression="lz4")
    stack.put(key, obj)                 # lands in the top tier now; lower tiers in background
    stack.prefetch(keys)                # promote into the top tier in background
    fut = stack.read_layer_async(key, l)   # ask for layer l+1 while computing layer l
    stack.read_layers(key, idxs, outs)  # or synchronously, straight into caller buffers
    stack.flush(timeout_s)              # wait for pending write-downs (and promotions)
    stack.close()

Reads take the first tier (top first) that holds a valid object and promote it into every
tier above (asynchronously; the promoted copy is stored uncompressed in the top tier and
as given below it). Writes land in the top tier synchronously and go down asynchronously
(:mod:`tiers.write_behind`: bounded, ``writes_dropped`` past it; a chunk evicted from the top
before its write-down landed is put back from the pending write, ``write_behind_hits``)
to the tiers named in ``write_down`` that lack the key, lz4-compressed (per layer, where it
pays: see :func:`tiers.lower.recode`) when ``compression="lz4"``; ``raw_top=False`` encodes the
top tier like those (a top below memory: the cache shard's disk). A chunk is pinned in the
tier it is read from for the duration of the read (tiers with ``pin``/``unpin``), so
eviction never pulls it from under an in-flight read. Puts are idempotent (each tier is
first-wins). Reading never changes stored bytes; an object found corrupt in a tier is
deleted from that tier (and counted), so a later put can store a good one.

Failure behaviour: inherits each tier's (a fault is a miss of that tier; the read falls
through to the next; a ``put``/``delete`` that raises is a failed write / logged). Nothing
raises to the caller for cache faults: reads return None (or a future resolving to None),
puts return False/complete quietly; counters in ``stats()['stack']`` and, per tier, through
``on_event``. Caller mistakes raise ``ValueError``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from tiers.format import PREFIX_BYTES, ChunkHeader, FormatError
from tiers.header_cache import HeaderCache
from tiers.keys import ChunkKey
from tiers.lower import recode, shared_tiers
from tiers.ownership import OLDER, classify
from tiers.reader import ReadCounters, validate_object
from tiers.stack_reads import StackReads
from tiers.tier import Buffer, Tier
from tiers.write_behind import WriteBehind

log = logging.getLogger(__name__)

_HEADER_CACHE = 4096

#: ``on_event(kind, tier name, nbytes)``: see :class:`TierStack`
EventHook = Callable[[str, str, int], None]


class TierStack(StackReads):
    """Byte tiers composed top (fastest) to bottom (see module docstring).

    Args:
        tiers: tiers, top first; names must be unique.
        write_down: names of lower tiers every put is copied to (default: all lower tiers).
        compression: ``"lz4"`` (compress below the top tier) or ``"none"``.
        promote: copy hits from lower tiers into the tiers above them.
        max_workers: threads for write-down and promotion, and as many for async reads.
        raw_top: the top tier holds raw objects (put and promotion decode lz4). False: it
            is encoded like the tiers below (put compresses; promotion copies as found).
        on_event: ``on_event(kind, tier name, nbytes)``, from any thread, for each
            ``"write"`` (a put, write-down or promotion stored ``nbytes`` there),
            ``"write_failed"`` and ``"corrupt"`` (an object failed validation and was
            deleted); its exceptions are logged.

    Raises:
        ValueError: no tiers, duplicate names, unknown ``write_down`` names or compression.
    """

    def __init__(self, tiers: Sequence[Tier], *, write_down: Sequence[str] | None = None,
                 compression: str = "lz4", promote: bool = True, max_workers: int = 4,
                 raw_top: bool = True, on_event: EventHook | None = None) -> None:
        if not tiers:
            raise ValueError("a TierStack needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if compression not in ("lz4", "none"):
            raise ValueError(f"compression={compression!r}: choose lz4 or none")
        lower = names[1:]
        self.write_down = tuple(lower if write_down is None else write_down)
        unknown = [n for n in self.write_down if n not in lower]
        if unknown:
            raise ValueError(f"write_down names {unknown} are not lower tiers of {names}")
        self.tiers = list(tiers)
        self.compression = compression
        self.promote = promote
        self.raw_top = raw_top
        self.on_event = on_event
        # Separate pools: a burst of write-downs must not queue ahead of a layer read that
        # the blend engine is about to wait for.
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tierstack-io")
        self._read_pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tierstack-read")
        self._lock = threading.RLock()
        self._pending: set[Future] = set()
        self._promoting: dict[ChunkKey, Future] = {}
        self._headers = HeaderCache(_HEADER_CACHE)
        self.counters = ReadCounters()
        self._stats = {"write_down_failures": 0, "writes_dropped": 0, "write_behind_hits": 0,
                       "promotions": 0, "corrupt_deleted": 0}
        self._behind = WriteBehind(self._write_held, self._write_dropped, self._undo_write,
                                   max_workers, "tierstack-write")
        self.name = "stack"

    @classmethod
    def from_config(cls, cfg, disk_path: str, **kwargs) -> TierStack:
        """host → disk → redis → s3 as a :class:`tiers.config.TiersConfig` describes them (a tier
        sized 0, without a URL or that cannot be opened is left out: see :func:`shared_tiers`);
        every lower tier is written down; ``io_timeout_s`` bounds each disk call.

        Raises:
            ValueError: from the host or disk tier's constructor.
        """
        from tiers.disk import DiskTier
        from tiers.host import HostTier

        tiers: list[Tier] = [HostTier(int(cfg.host_size_gib * 2**30), cfg.eviction_policy)]
        if cfg.disk_size_gib > 0:
            tiers.append(DiskTier(disk_path, int(cfg.disk_size_gib * 2**30), cfg.eviction_policy, io_timeout_s=cfg.io_timeout_s))
        tiers += shared_tiers(cfg)
        return cls(tiers, compression=cfg.compression, **kwargs)

    # -- bookkeeping ---------------------------------------------------------------------
    def _submit(self, fn, *args) -> Future:
        fut = self._pool.submit(fn, *args)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
        if fut.exception() is not None:  # a bug, not a cache fault: keep it visible
            log.error("tier stack background task failed", exc_info=fut.exception())

    def _bump(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1

    def _emit(self, kind: str, tier: Tier, nbytes: int) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(kind, tier.name, nbytes)
        except Exception:  # noqa: BLE001 - an observer's bug must not break the data path
            log.exception("tier stack on_event(%s, %s) failed", kind, tier.name)

    def _corrupt(self, tier: Tier, key: ChunkKey) -> None:
        """Count and drop an object of ``tier`` that failed validation."""
        self.counters.add("corrupt")
        self._bump("corrupt_deleted")
        self._delete_from(tier, [key])
        self._emit("corrupt", tier, 0)

    def _delete_from(self, tier: Tier, keys: Sequence[ChunkKey]) -> int:
        try:
            return tier.delete(keys)
        except Exception as e:  # noqa: BLE001 - a failing tier must not fail the caller
            log.warning("tier stack: delete on %s failed: %s", tier.name, e)
            return 0

    def _put_tier(self, tier: Tier, key: ChunkKey, obj: Buffer) -> bool:
        try:
            ok = bool(tier.put(key, obj))
        except Exception as e:  # noqa: BLE001 - a failing tier is a failed write
            log.debug("tier stack: put to %s failed: %s", tier.name, e)
            ok = False
        self._emit("write" if ok else "write_failed", tier, memoryview(obj).nbytes)
        return ok

    def _form(self, obj: Buffer, key: ChunkKey, header: ChunkHeader, top: bool) -> Buffer:
        """``obj`` as the top tier (``top``) or a lower tier stores it."""
        if self.compression != "lz4":
            return obj
        return recode(obj, key, not (top and self.raw_top), header)

    def _cached_header(self, tier: Tier, key: ChunkKey) -> ChunkHeader | None:
        return self._headers.get(tier.name, key)

    def _cache_header(self, tier: Tier, key: ChunkKey, header: ChunkHeader | None) -> None:
        self._headers.put(tier.name, key, header)

    # -- writes --------------------------------------------------------------------------
    def put(self, key: ChunkKey, obj: Buffer, header: ChunkHeader | None = None) -> bool:
        """Store an encoded chunk object: top tier now, ``write_down`` tiers in background.

        Args:
            header: ``validate_object(obj, key)``'s result when the caller already checked it.

        Returns:
            Whether the top tier took it (a full top tier still writes down).

        Raises:
            ValueError: ``obj`` is not a valid chunk object of ``key``.
        """
        if header is None:
            try:
                header = validate_object(obj, key)
            except FormatError as e:
                raise ValueError(f"put of {key}: not a valid chunk object: {e}") from None
        top, low, ok = self.tiers[0], None, True
        if not top.contains([key])[0]:  # first wins: no re-encoding for a present key
            form = self._form(obj, key, header, True)
            ok = self._put_tier(top, key, form)
            low = None if self.raw_top else form  # then the lower form already: no 2nd recode
        if self.write_down:
            self._behind.submit(key, obj, (header, low))
        return ok

    def _write_held(self, key: ChunkKey, obj: Buffer, forms: tuple[ChunkHeader, Buffer | None]) -> None:
        """A pending write-down (``forms``: the header and the lower form when known)."""
        for ok in self._store(key, obj, forms[0], self.write_down, forms[1]).values():
            if not ok:
                self._bump("write_down_failures")

    def _write_dropped(self, pending: int, pending_bytes: int, first: bool) -> None:
        self._bump("writes_dropped")
        if first:
            log.warning("tier stack: %d write-downs (%d bytes) pending, the bound: dropping new "
                        "ones (top tier only; counted writes_dropped; warned once)", pending, pending_bytes)

    def _undo_write(self, key: ChunkKey) -> None:
        """A write-down that landed after its chunk was deleted: delete it there too."""
        for tier in self.tiers:
            if tier.name in self.write_down:
                self._delete_from(tier, [key])

    def _restore(self, key: ChunkKey) -> None:
        """Put ``key`` back into the top tier from its pending write-down when the top evicted it
        before the write landed (it was in no tier): see :mod:`tiers.write_behind`."""
        if self._behind.held(key) is None or self.tiers[0].contains([key])[0]:
            return
        top = self.tiers[0]
        if self._behind.restore(key, lambda obj, forms: self._put_tier(top, key, self._form(obj, key, forms[0], True))):
            self._bump("write_behind_hits")

    def store(self, key: ChunkKey, obj: Buffer, names: Sequence[str], *,
              header: ChunkHeader | None = None) -> dict[str, bool]:
        """Now, into the named tiers lacking ``key`` (a tier holding it is not rewritten),
        encoded as this stack stores it there; ``header`` as in :meth:`put`. Returns per
        name whether that tier holds it now. Raises ``ValueError`` for an unknown name or
        an invalid object."""
        if set(names) - {t.name for t in self.tiers}:
            raise ValueError(f"tiers {list(names)} are not all in this stack")
        try:
            header = validate_object(obj, key) if header is None else header
        except FormatError as e:
            raise ValueError(f"store of {key}: not a valid chunk object: {e}") from None
        return self._store(key, obj, header, names, None)

    def _store(self, key: ChunkKey, obj: Buffer, header: ChunkHeader, names: Sequence[str],
               low: Buffer | None) -> dict[str, bool]:
        """:meth:`store` of a checked object; ``low``: its lower form when known."""
        out: dict[str, bool] = {}
        for tier in self.tiers:
            if tier.name not in names:
                continue
            if tier.contains([key])[0]:
                out[tier.name] = True
            elif tier is self.tiers[0] and self.raw_top:
                out[tier.name] = self._put_tier(tier, key, self._form(obj, key, header, True))
            else:
                if low is None:
                    low = self._form(obj, key, header, False)
                out[tier.name] = self._put_tier(tier, key, low)
        return out

    def flush(self, timeout_s: float | None = 60.0) -> bool:
        """Wait for pending write-downs and promotions; True when all finished in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._behind.drain(timeout_s):
            return False
        with self._lock:
            pending = list(self._pending)
        done, not_done = wait(pending, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not not_done

    # -- promotion -----------------------------------------------------------------------
    def prefetch(self, keys: Sequence[ChunkKey]) -> list[Future]:
        """Promote each key into the top tier in background; futures resolve to True when
        the key is (now) in the top tier."""
        futs: list[Future] = []
        top = self.tiers[0]
        for key in keys:
            self._restore(key)
        for key, present in zip(keys, top.contains(keys), strict=False):
            if present:
                f: Future = Future()
                f.set_result(True)
                futs.append(f)
            else:
                futs.append(self._promote(key, 1))
        return futs

    def _promote(self, key: ChunkKey, start: int, obj: Buffer | None = None) -> Future:
        """Copy ``key`` into the tiers above the first tier (from index ``start`` down)
        holding it; ``obj`` is that tier's object when the caller already has it."""
        with self._lock:  # re-entrant: _submit takes it too; no window for a stale entry
            fut = self._promoting.get(key)
            if fut is None:
                fut = self._submit(self._promote_now, key, start, obj)
                self._promoting[key] = fut
            return fut

    def _promote_now(self, key: ChunkKey, start: int, obj: Buffer | None) -> bool:
        try:
            if obj is None:
                found = self._find_from(max(start, 1), key)
                if found is None:
                    return False
                src, obj, header = found
            else:
                src = start
                try:
                    header = validate_object(obj, key)
                except FormatError:
                    self._corrupt(self.tiers[src], key)
                    return False
            # raw_top off: the top tier takes the object as found, like the tiers below it
            top = self._form(obj, key, header, True) if self.raw_top else obj
            ok = True
            for tier in self.tiers[:src]:
                ok = self._put_tier(tier, key, top if tier is self.tiers[0] else obj) and ok
            self._bump("promotions")
            return ok
        finally:
            with self._lock:
                self._promoting.pop(key, None)

    # -- pins --------------------------------------------------------------------------
    def pin(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Pin ``keys`` in every tier that supports pins (host, disk), e.g. for the whole of
        a request that reads them layer by layer; returns which were pinned somewhere.
        Every call needs a matching :meth:`unpin`."""
        pinned = [False] * len(keys)
        for tier in self.tiers:
            pin = getattr(tier, "pin", None)
            if pin is not None:
                pinned = [p or q for p, q in zip(pinned, pin(keys), strict=False)]
        return pinned

    def unpin(self, keys: Sequence[ChunkKey]) -> None:
        """Undo one :meth:`pin` of each key."""
        for tier in self.tiers:
            unpin = getattr(tier, "unpin", None)
            if unpin is not None:
                unpin(keys)

    # -- admin ---------------------------------------------------------------------------
    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Delete from every tier; returns how many keys were present in at least one."""
        present = [self._behind.held(k) is not None for k in keys]
        self._behind.forget(keys)  # a pending write-down must not bring one back
        for tier in self.tiers:
            hits = tier.contains(keys)
            self._delete_from(tier, keys)
            present = [p or h for p, h in zip(present, hits, strict=False)]
        self._forget(keys)
        return sum(present)

    def clear(self, namespace: str | None = None, *, stale: bool = False) -> int:
        """Delete every chunk (of ``namespace``; ``stale``: only of an older format, :mod:`tiers.ownership`)
        from the tiers that list keys (host, disk; not Redis/S3); returns how many."""
        n = 0
        if not stale:
            self._behind.forget([k for k in self._behind.keys() if namespace is None or k.namespace == namespace])
        for tier in (t for t in self.tiers if hasattr(t, "keys")):
            keys = [k for k in tier.keys() if namespace is None or k.namespace == namespace]
            if stale:
                keys = [k for k in keys if classify((tier.get_ranges(k, [(0, PREFIX_BYTES)]) or [b""])[0]) == OLDER]
            n += self._delete_from(tier, keys)
            self._forget(keys)
        return n

    def _forget(self, keys: Sequence[ChunkKey]) -> None:
        self._headers.forget([t.name for t in self.tiers], keys)

    def stats(self) -> dict[str, dict[str, float]]:
        with self._lock:
            stack = {**self._stats, **self.counters.snapshot(), "pending": len(self._pending) + len(self._behind)}
        return {"stack": stack, **{t.name: t.stats() for t in self.tiers}}

    def close(self, timeout_s: float = 60.0) -> bool:
        """Flush, then stop the background threads. Returns :meth:`flush`'s result."""
        ok = self.flush(timeout_s)
        self._behind.close(wait=False)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._read_pool.shutdown(wait=False, cancel_futures=True)
        return ok

