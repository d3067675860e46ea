"""Reads through a :class:`tiers.stack.TierStack`: the first tier (top first) holding a valid
object answers; a hit below the top is promoted (the stack's ``_promote``); a corrupt copy is
deleted from its tier and counted (``_corrupt``), and the read falls through to the next tier.

Headers are cached per tier (``_headers``): an object never changes under a key, except when
evicted and written again with another encoding, which :meth:`StackReads.read_layers` tells
apart from corruption. Before each read a chunk whose write-down is still pending and that the
top tier evicted is put back there (``_restore``; :mod:`tiers.write_behind`).

A mixin of :class:`~tiers.stack.TierStack`, split from it by meaning (reading vs. writing,
promoting and administering); it uses the stack's ``tiers``, ``promote``, ``counters``,
``_read_pool`` and the helpers named above.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from tiers.format import ChunkHeader
from tiers.keys import ChunkKey
from tiers.reader import ReadCounters, read_header, read_layers, read_object
from tiers.tier import Buffer


class StackReads:
    """The read half of :class:`~tiers.stack.TierStack` (see the module docstring)."""

    def locate(self, keys: Sequence[ChunkKey]) -> list[str | None]:
        """Name of the first tier holding each key (one batch call per tier), or None."""
        for key in keys:
            self._restore(key)
        where: list[str | None] = [None] * len(keys)
        for tier in self.tiers:
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            for i, hit in zip(todo, tier.contains([keys[i] for i in todo]), strict=False):
                if hit:
                    where[i] = tier.name
        return where

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [w is not None for w in self.locate(keys)]

    def read_layers(self, key: ChunkKey, layer_idxs: Sequence[int],
                    outs: Sequence[Buffer]) -> ChunkHeader | None:
        """Read layers into the caller's buffers from the first tier with a valid object.

        Shapes: each ``outs[i]`` is a writable buffer of the layer's raw ``[2, T, H, D]``
        bytes (``header.layer_nbytes``). Returns the header, or None when no tier has a
        valid object (then ``outs`` are unspecified).

        Raises:
            ValueError: see :func:`tiers.reader.read_layers`.
        """
        self._restore(key)
        for depth, tier in enumerate(self.tiers):
            pin = getattr(tier, "pin", None)
            pinned = pin([key])[0] if pin is not None else False
            try:
                local = ReadCounters()
                cached = self._cached_header(tier, key)
                if cached is None:
                    header = read_header(tier, key, local)
                    got = None if header is None else read_layers(
                        tier, key, layer_idxs, outs, header=header, counters=local)
                else:
                    got = read_layers(tier, key, layer_idxs, outs, header=cached, counters=local)
                    if got is None and local.snapshot()["corrupt"]:
                        # A stale cached header fails the checks too: the object under a key
                        # may have been re-encoded (evicted, then written again by a process
                        # with another compression setting). Corrupt only if its header is
                        # unchanged (or itself corrupt); a header that cannot be read now is
                        # a miss, never a reason to delete.
                        first, local = local, ReadCounters()
                        fresh = read_header(tier, key, local)
                        if fresh == cached:
                            local = first
                        elif fresh is not None:
                            got = read_layers(tier, key, layer_idxs, outs, header=fresh, counters=local)
            finally:
                if pinned:
                    tier.unpin([key])
            if got is not None:
                self._cache_header(tier, key, got)
                self.counters.add("hits")
                if depth > 0 and self.promote:
                    self._promote(key, depth)
                return got
            self._cache_header(tier, key, None)
            if local.snapshot()["corrupt"]:
                self._corrupt(tier, key)
        self.counters.add("misses")
        return None

    def read_layer_async(self, key: ChunkKey, layer_idx: int,
                         out: Buffer | None = None) -> Future[memoryview | None]:
        """Layer ``layer_idx`` of ``key`` in the background: a future of the raw ``[2, T, H, D]``
        bytes (``out`` when given, else a fresh buffer), or of None on a miss."""
        return self._read_pool.submit(self._read_one, key, layer_idx, out)

    def _read_one(self, key: ChunkKey, layer_idx: int, out: Buffer | None) -> memoryview | None:
        self._restore(key)
        if out is None:
            header = None
            for tier in self.tiers:
                header = self._cached_header(tier, key)
                if header is not None:
                    break
            if header is None:
                for tier in self.tiers:
                    header = read_header(tier, key)
                    if header is not None:
                        self._cache_header(tier, key, header)
                        break
            if header is None:
                self.counters.add("misses")
                return None
            try:
                out = bytearray(header.layer_nbytes)
            except MemoryError:  # a miss, never an exception out of the future
                self.counters.add("oversized")
                return None
        view = memoryview(out).cast("B")
        return view if self.read_layers(key, [layer_idx], [view]) is not None else None

    def get(self, key: ChunkKey) -> Buffer | None:
        """The whole object from the first tier holding a valid one (promoting it), or None."""
        found = self.find(key)
        return None if found is None else found[1]

    def find(self, key: ChunkKey) -> tuple[str, Buffer, ChunkHeader] | None:
        """As :meth:`get`, with the name of the tier it came from and its validated header:
        ``(tier name, object, header)``, or None when no tier holds a valid object."""
        self._restore(key)
        found = self._find_from(0, key)
        if found is None:
            self.counters.add("misses")
            return None
        depth, obj, header = found
        self.counters.add("hits")
        if depth > 0 and self.promote:
            self._promote(key, depth, obj)
        return self.tiers[depth].name, obj, header

    def _find_from(self, first: int, key: ChunkKey) -> tuple[int, Buffer, ChunkHeader] | None:
        """``(depth, object, header)`` of the first tier from ``first`` down holding a valid
        whole object (Redis/S3 read no more than the object its header describes:
        :func:`tiers.reader.read_object`); a corrupt one met on the way is deleted."""
        for depth in range(first, len(self.tiers)):
            tier, local, cached = self.tiers[depth], ReadCounters(), self._cached_header(self.tiers[depth], key)
            got = read_object(tier, key, local, header=cached)
            if got is None and cached is not None and not local.snapshot()["corrupt"]:
                got = read_object(tier, key, local)  # re-encoded since, maybe longer: its own header
            if got is not None:
                return depth, *got
            if local.snapshot()["corrupt"]:
                self._corrupt(tier, key)
        return None

    def get_ranges(self, key: ChunkKey, ranges: Sequence[tuple[int, int]]) -> list[Buffer] | None:
        """Byte ranges from the first tier holding ``key`` (no validation: use
        :meth:`read_layers` for checked KV)."""
        self._restore(key)
        for tier in self.tiers:
            got = tier.get_ranges(key, ranges)
            if got is not None:
                return got
        return None
