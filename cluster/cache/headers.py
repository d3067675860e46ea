"""The client's caches: parsed chunk headers (an LRU bounded by an estimate of its bytes) and
the whole chunk objects it holds between requests (an LRU bounded by their bytes).

A header's size grows with its layers (one :class:`tiers.format.LayerEntry` each) and
position runs, and the client's entry keeps the expanded position list (one slot per
token) once asked for it, so a bound by count alone does not bound memory: 65536 headers of
a 32-layer model of 256-token chunks are ~1.2 GiB. :class:`HeaderCache` keeps a running
:func:`entry_nbytes` total through every insertion and removal and :meth:`HeaderCache.trim`
drops the oldest entries until it is within a budget.

The estimate (measured with ``tracemalloc`` on CPython 3.11, 32 layers, 256 tokens:
~8.6 KB per parsed header with one run, +77 B per further run, ~40 B per position) errs
high; it is a bound for eviction, not an accounting.

:class:`HeldObjects` keeps the objects a transport handed over (mapped Ray objects, arena
slots, a local tier's bytes) with their own headers, bounded the same way by their bytes
(dropping one drops the client's reference only: a mapped object is unpinned, an arena slot
freed, once no reader holds a view of it either); :func:`own_header` checks the header
inside such an object against the one a lookup returned, and :func:`object_bound` bounds an
object's bytes from its header (what an arena slot reserves).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from tiers.format import ChunkHeader, FormatError, parse_header

#: the entry, its header object, the key strings and the ordered-dict slot
HEADER_OVERHEAD_BYTES = 1024
#: one LayerEntry (a frozen dataclass of five ints) in the header's tuple
LAYER_ENTRY_BYTES = 288
#: one (start, length) position run
POSITION_RUN_BYTES = 96
#: one token of the entry's expanded position tuple (a slot plus an int object)
POSITION_BYTES = 40


def entry_nbytes(entry) -> int:
    """Estimated bytes one cached entry (anything with a ``.header``, a
    :class:`tiers.format.ChunkHeader`) holds, its position list included."""
    h = entry.header
    return (HEADER_OVERHEAD_BYTES + LAYER_ENTRY_BYTES * len(h.layers)
            + POSITION_RUN_BYTES * len(h.positions) + POSITION_BYTES * h.num_tokens)


class SizedLRU(OrderedDict):
    """An ``OrderedDict`` (oldest first) that keeps :attr:`nbytes`, the sum of
    ``nbytes_of(value)`` over its values, through ``[]=``, ``del``, ``pop``, ``popitem`` and
    ``clear``. Not thread-safe by itself (the client holds its lock)."""

    def __init__(self, nbytes_of) -> None:
        self.nbytes = 0
        self._nbytes_of = nbytes_of
        super().__init__()

    # pop and popitem remove through this class's __delitem__, never OrderedDict's own pop
    # (whether that calls a subclass's __delitem__ is an implementation detail)
    def __setitem__(self, key: Hashable, entry) -> None:
        if key in self:
            self.nbytes -= self._nbytes_of(super().__getitem__(key))
        super().__setitem__(key, entry)
        self.nbytes += self._nbytes_of(entry)

    def __delitem__(self, key: Hashable) -> None:
        entry = super().__getitem__(key)
        super().__delitem__(key)
        self.nbytes -= self._nbytes_of(entry)

    def pop(self, key: Hashable, *default):
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        entry = super().__getitem__(key)
        self.__delitem__(key)
        return entry

    def popitem(self, last: bool = True):
        if not self:
            raise KeyError("dictionary is empty")
        key = next(reversed(self)) if last else next(iter(self))
        entry = super().__getitem__(key)
        self.__delitem__(key)
        return key, entry

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0

    def trim(self, max_bytes: int) -> list[Hashable]:
        """Drop the oldest entries until :attr:`nbytes` <= ``max_bytes``; returns their keys."""
        dropped = []
        while self.nbytes > max_bytes and self:
            dropped.append(self.popitem(last=False)[0])
        return dropped


class HeaderCache(SizedLRU):
    """``key -> HeaderEntry``, its bytes by :func:`entry_nbytes`."""

    def __init__(self) -> None:
        super().__init__(entry_nbytes)


class HeldObjects(SizedLRU):
    """``key -> (object, its own header, checked, progress)``, its bytes the objects' (uint8
    arrays)."""

    def __init__(self) -> None:
        super().__init__(lambda held: held[0].nbytes)


class HeaderEntry:
    """What a :class:`cluster.cache.client.CacheClient` knows about one chunk after a lookup:
    its parsed header, where it was found (the shard or tier that answered, ``""`` for a
    shared tier read directly) and the tier."""

    __slots__ = ("header", "shard", "tier", "_positions")

    def __init__(self, header: ChunkHeader, shard: str, tier: str) -> None:
        self.header = header
        self.shard = shard
        self.tier = tier
        self._positions: tuple[int, ...] | None = None

    def positions(self) -> tuple[int, ...]:
        if self._positions is None:
            self._positions = tuple(self.header.position_list())
        return self._positions


def own_header(key, looked_up: ChunkHeader, obj) -> ChunkHeader:
    """The header inside the mapped object ``obj`` of ``key``, checked against the one a lookup
    returned. The bytes of a chunk differ between tiers (a shard restarted after its host copy
    died promotes the lz4-compressed Redis/S3 copy), so layers are sliced with the object's
    own offsets; what it describes must be the same chunk.

    Raises:
        FormatError: the object's header does not parse as ``key``'s, or describes another
            dtype, layer count, layer shape or positions than ``looked_up``.
    """
    own = parse_header(memoryview(obj), expected_key=key)
    if (own.dtype, own.num_layers, own.layer_shape, own.positions) != (
            looked_up.dtype, looked_up.num_layers, looked_up.layer_shape, looked_up.positions):
        raise FormatError(f"object of {key} does not match its looked-up header")
    return own


def object_bound(header: ChunkHeader) -> int:
    """An upper bound of the bytes of ``header``'s chunk object in any encoding (its layers raw
    or lz4: a tier stores a layer raw when lz4 does not shrink it): what an arena slot reserves."""
    return max(header.total_bytes, header.header_end + header.num_layers * (header.layer_nbytes + 64))


def arrived(held: tuple, layer, deadline: float) -> bool:
    """Whether the bytes of ``layer`` (a :class:`tiers.format.LayerEntry`, or None: the whole
    object) of ``held`` are in place, waiting for an object still arriving until ``deadline``."""
    obj, header, _checked, progress = held
    if progress is None:
        return True
    end = obj.nbytes if layer is None else layer.offset + layer.stored_len
    return progress.wait(end, header.header_end, obj.nbytes, deadline)
