"""Read layers of a chunk object from any :class:`~tiers.tier.Tier` into the caller's buffers.

Every tier serves bytes; this module is where they become trusted KV, once, for all tiers:

1. **Header** — one ranged read of the first :data:`~tiers.format.HEADER_PROBE_BYTES`
   (clamped to the object's size: a tier's optional ``head(key, max_bytes)`` returns the
   first ``min(max_bytes, size)`` bytes; tiers without it fall back to ``get_ranges`` and,
   for objects shorter than the probe, ``get``), validated by
   :func:`tiers.format.parse_header` against the expected key (namespace included) and
   format version. A header longer than the probe costs one more ranged read.
2. **Layers** — exactly the wanted layers' byte ranges, in one ``get_ranges`` call; or,
   when the tier has ``get_ranges_into`` (disk ``preadv``, S3 streaming), in one call that
   puts raw layers straight into the caller's buffers (no intermediate copy) and lz4
   layers into scratch buffers. A tier with ``get_ranges_into_each`` (disk) reads a layer at
   a time and lets step 3 check each as it lands, while it is still in the CPU's cache (a
   second pass over a layer read from memory costs about half of the read itself).
   A whole-chunk read without a known header from a tier with ``open_stream`` (S3) is one
   request: the stream's prefix and header are parsed, then the layers are read from the
   same stream in order, raw ones straight into the caller's buffers.
3. **Check and decode** — XXH3-64 of each stored payload (and, with an object key, its
   Poly1305 tag, :mod:`tiers.auth`), lz4 decompression where the
   header says so, into the caller's ``[2, T, H, D]`` buffer. A tier with
   ``get_ranges_verified`` (host memory) says which header its bytes were checked against
   when they entered it; a layer whose entry (offset, length, codec, checksum) is that
   header's is copied without hashing it again (a stale or foreign header is checked).

Whole objects (a promotion into host memory): :func:`read_object` asks a tier that takes a
bound (Redis, S3) for no more than the object its header describes, so a planted value longer
than that is a miss before it is read.

Failure behaviour: a missing object, an I/O error or timeout of the tier, or anything
:class:`~tiers.format.FormatError` covers (truncated, flipped byte, foreign namespace, newer
version, lz4 garbage, a length or offset past what the header describes) is a miss: functions
return ``None`` and count it in the :class:`ReadCounters` given (``misses`` / ``corrupt``; a
``MemoryError`` on any read path: ``oversized``). Only caller mistakes raise
(``ValueError`` for a read-only output buffer or mismatched argument lengths). On a miss the output
buffers' contents are unspecified (possibly partly written); never use them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from tiers.format import (
    CODEC_RAW,
    HEADER_PROBE_BYTES,
    PREFIX_BYTES,
    ChunkHeader,
    FormatError,
    LayerEntry,
    check_payload,
    decode_layer,
    parse_header,
    parse_prefix,
)
from tiers.keys import ChunkKey
from tiers.tier import Buffer, Tier

log = logging.getLogger(__name__)


#: bytes a stream read skips at a time (the gaps between wanted layers), never more at once
_SKIP_BYTES = 1 << 20


class ReadCounters:
    """Thread-safe counters of reads: ``hits``, ``misses`` (absent or tier error), ``corrupt``
    (present but rejected by the format checks) and ``oversized`` (larger than the bound of a
    whole-object read, or memory for it could not be had: a ``MemoryError``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = {"hits": 0, "misses": 0, "corrupt": 0, "oversized": 0}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


def _head(tier: Tier, key: ChunkKey, nbytes: int) -> Buffer | None:
    head = getattr(tier, "head", None)
    if head is not None:
        return head(key, nbytes)
    got = tier.get_ranges(key, [(0, nbytes)])
    if got is not None:
        return got[0]
    return tier.get(key)  # shorter than the probe (or absent)


def read_header(tier: Tier, key: ChunkKey, counters: ReadCounters | None = None) -> ChunkHeader | None:
    """Fetch and validate the header of ``key``'s object; None on a miss (counted). A tier
    with ``checked_header`` (host memory) gives the one it checked the object against when it
    entered, without parsing it again."""
    checked = getattr(tier, "checked_header", None)
    if checked is not None:
        header = checked(key)
        if header is not None:
            return header
    try:
        buf = _head(tier, key, HEADER_PROBE_BYTES)
    except MemoryError:
        _out_of_memory(tier, key, counters)
        return None
    if buf is None or len(buf) == 0:
        _count(counters, "misses")
        return None
    try:
        try:
            return parse_header(buf, expected_key=key)
        except FormatError as e:
            if "truncated header" not in str(e) or len(buf) < HEADER_PROBE_BYTES:
                raise
        # a header longer than the probe: read exactly the prefix + header
        end = PREFIX_BYTES + parse_prefix(buf)
        got = tier.get_ranges(key, [(0, end)])
        if got is None:
            _count(counters, "misses")
            return None
        return parse_header(got[0], expected_key=key)
    except FormatError as e:
        log.debug("%s: rejected header of %s: %s", getattr(tier, "name", tier), key, e)
        _count(counters, "corrupt")
        return None
    except MemoryError:
        _out_of_memory(tier, key, counters)
        return None


def read_object(tier: Tier, key: ChunkKey, counters: ReadCounters | None = None,
                *, header: ChunkHeader | None = None) -> tuple[Buffer, ChunkHeader] | None:
    """``key``'s whole object from ``tier``, checked whole (:func:`validate_object`), with its
    header; None on a miss (counted). A tier that takes a bound (``max_object_bytes``: Redis,
    S3) is asked for no more than the object its header describes (``header``, else one
    probe, :func:`read_header`): its layers of ``[2, T, H, D]`` at the dtype's size, plus the
    header; a longer value is a miss (counted in ``misses`` here and in the tier's
    ``oversized``), found before the value is read, never allocated. A ``MemoryError``
    counts ``oversized``."""
    bounded = getattr(tier, "max_object_bytes", None) is not None
    try:
        if bounded:
            if header is None:
                header = read_header(tier, key, counters)
            if header is None:
                return None
            obj = tier.get(key, max_bytes=header.total_bytes)
        else:
            obj = tier.get(key)
        if obj is None:
            _count(counters, "misses")  # absent, an error, or over the bound (the tier's count)
            return None
        return obj, validate_object(obj, key)
    except FormatError as e:
        log.debug("%s: rejected %s: %s", getattr(tier, "name", tier), key, e)
        _count(counters, "corrupt")
    except MemoryError:
        _out_of_memory(tier, key, counters)
    return None


def read_layers(tier: Tier, key: ChunkKey, layer_idxs: Sequence[int], outs: Sequence[Buffer],
                *, header: ChunkHeader | None = None,
                counters: ReadCounters | None = None) -> ChunkHeader | None:
    """Read layers ``layer_idxs`` of ``key`` into ``outs`` (one writable buffer per layer).

    Args:
        tier: any Tier (optionally with ``head``/``get_ranges_into`` fast paths).
        layer_idxs: layer indices, each in ``0..L-1`` (an index past the object's layers is
            a miss: the object does not match what the namespace promised).
        outs: writable buffers of ``header.layer_nbytes`` bytes each, filled with the raw
            ``[2, T, H, D]`` layer (K then V, the header's dtype).
        header: a header already read from this tier for this key (skips the probe).

    Returns:
        The header on success, None on a miss (see module docstring).

    Raises:
        ValueError: ``outs`` and ``layer_idxs`` differ in length, or a buffer is read-only.
            (A buffer whose size does not match the stored object's layers is a miss,
            logged as a warning: the object under this key is not what the caller looked up.)
    """
    if len(outs) != len(layer_idxs):
        raise ValueError(f"{len(layer_idxs)} layers but {len(outs)} output buffers")
    views = [memoryview(o).cast("B") for o in outs]
    for v in views:
        if v.readonly:
            raise ValueError("output buffer is read-only")
    if header is None:
        opener = getattr(tier, "open_stream", None)
        if opener is not None and len(layer_idxs) > 1:  # one request for header and layers (S3)
            return _read_stream(tier, opener, key, layer_idxs, views, counters)
        header = read_header(tier, key, counters)
        if header is None:
            return None
    if not _fits(tier, key, header, views, counters):
        return None
    if any(not 0 <= i < header.num_layers for i in layer_idxs):
        log.debug("%s: layer index past %d layers of %s", getattr(tier, "name", tier),
                  header.num_layers, key)
        _count(counters, "corrupt")
        return None
    entries = [header.layers[i] for i in layer_idxs]
    ranges = [(e.offset, e.stored_len) for e in entries]
    into = getattr(tier, "get_ranges_into", None)
    into_each = getattr(tier, "get_ranges_into_each", None)
    try:
        if into_each is not None:
            _read_each(into_each, key, header, layer_idxs, entries, ranges, views)
        elif into is not None:
            # raw layers land straight in the caller's buffers; lz4 layers in scratch buffers
            scratch = [None if e.codec == CODEC_RAW else bytearray(e.stored_len) for e in entries]
            targets = [v if b is None else memoryview(b) for v, b in zip(views, scratch, strict=False)]
            if not into(key, ranges, targets):
                _count(counters, "misses")
                return None
            for i, v, b in zip(layer_idxs, views, scratch, strict=False):
                if b is None:
                    check_payload(header, i, v)
                else:
                    decode_layer(header, i, b, v)
        else:
            verified = getattr(tier, "get_ranges_verified", None)
            if verified is not None:
                got = verified(key, ranges)
                payloads, checked = (None, None) if got is None else got
            else:
                payloads, checked = tier.get_ranges(key, ranges), None
            if payloads is None:
                _count(counters, "misses")
                return None
            for i, e, p, v in zip(layer_idxs, entries, payloads, views, strict=False):
                if checked is not None and i < len(checked.layers) and checked.layers[i] == e:
                    decode_layer(header, i, p, v, verify=False)  # passed this XXH3 on entry
                else:
                    decode_layer(header, i, p, v)
    except _Missing:
        _count(counters, "misses")
        return None
    except FormatError as e:
        log.debug("%s: rejected %s: %s", getattr(tier, "name", tier), key, e)
        _count(counters, "corrupt")
        return None
    except MemoryError:
        # buffers for the layers (up to MAX_LAYER_BYTES each) could not be had: a miss, the
        # request recomputes; never an exception into the caller's engine
        _out_of_memory(tier, key, counters)
        return None
    _count(counters, "hits")
    return header


def _out_of_memory(tier, key: ChunkKey, counters: ReadCounters | None) -> None:
    log.warning("%s: out of memory reading %s: treated as a miss", getattr(tier, "name", tier), key)
    _count(counters, "oversized")


class _Missing(Exception):
    """The tier answered a miss (internal to :func:`read_layers`)."""


def _read_each(into_each, key: ChunkKey, header: ChunkHeader, layer_idxs: Sequence[int],
               entries: Sequence[LayerEntry], ranges: Sequence[tuple[int, int]],
               views: Sequence[memoryview]) -> None:
    """Layers through ``get_ranges_into_each`` (disk): each layer is checked (and lz4 ones
    decoded) right after it lands, while it is still in the CPU's cache; lz4 layers share one
    scratch buffer. Raises FormatError (corrupt) or _Missing (the tier's miss)."""
    lz4_lens = [e.stored_len for e in entries if e.codec != CODEC_RAW]
    scratch = memoryview(bytearray(max(lz4_lens))) if lz4_lens else None
    targets = [v if e.codec == CODEC_RAW else scratch[:e.stored_len]
               for e, v in zip(entries, views, strict=True)]

    def check(j: int) -> None:
        e = entries[j]
        if e.codec == CODEC_RAW:
            check_payload(header, layer_idxs[j], views[j])
        else:
            decode_layer(header, layer_idxs[j], targets[j], views[j])

    if not into_each(key, ranges, targets, check):
        raise _Missing


def _fits(tier: Tier, key: ChunkKey, header: ChunkHeader, views: Sequence[memoryview],
          counters: ReadCounters | None) -> bool:
    for v in views:
        if v.nbytes != header.layer_nbytes:
            # The caller sized its buffers from an earlier lookup; an object of another shape
            # under this key now is a bad object (a miss), not an exception.
            log.warning("%s: %s holds layers of %d bytes ([2, %d, %d, %d] %s); the output "
                        "buffer has %d: treated as a miss", getattr(tier, "name", tier), key,
                        header.layer_nbytes, header.num_tokens, header.num_kv_heads,
                        header.head_dim, header.dtype, v.nbytes)
            _count(counters, "corrupt")
            return False
    return True


def _read_exact(stream, view: memoryview) -> None:
    filled = 0
    while filled < view.nbytes:
        n = stream.readinto(view[filled:])
        if not n:
            raise FormatError(f"truncated object: stream ended after {filled} of {view.nbytes} bytes")
        filled += n


def _skip(stream, nbytes: int) -> None:
    """Read and drop ``nbytes`` of ``stream``, :data:`_SKIP_BYTES` at a time at most."""
    scratch = memoryview(bytearray(min(nbytes, _SKIP_BYTES)))
    while nbytes > 0:
        n = min(nbytes, scratch.nbytes)
        _read_exact(stream, scratch[:n])
        nbytes -= n


def _read_stream(tier: Tier, opener, key: ChunkKey, layer_idxs: Sequence[int],
                 views: Sequence[memoryview], counters: ReadCounters | None) -> ChunkHeader | None:
    """Whole-object stream: prefix, header, then every layer up to the last wanted one in
    order (raw layers straight into the caller's buffers, others into scratch of at most the
    layer's raw size: :func:`~tiers.format.parse_header` bounds every length and offset). A
    stream that states its length (``length``: S3's ContentLength) must be the object its
    header describes; gaps are skipped in bounded pieces. Misses are counted (a
    ``MemoryError``: ``oversized``)."""
    stream = opener(key)
    if stream is None:
        _count(counters, "misses")
        return None
    try:
        prefix = bytearray(PREFIX_BYTES)
        _read_exact(stream, memoryview(prefix))
        rest = bytearray(parse_prefix(prefix))
        _read_exact(stream, memoryview(rest))
        header = parse_header(bytes(prefix) + rest, expected_key=key)
        length = getattr(stream, "length", None)
        if length is not None and length != header.total_bytes:
            raise FormatError(f"object has {length} bytes, header says {header.total_bytes}")
        if not _fits(tier, key, header, views, counters):
            return None
        if any(not 0 <= i < header.num_layers for i in layer_idxs):
            raise FormatError(f"layer index past {header.num_layers} layers")
        wanted = dict(zip(layer_idxs, views, strict=False))
        pos = header.header_end
        for i, e in sorted(enumerate(header.layers), key=lambda t: t[1].offset):
            if not wanted:
                break
            if e.offset < pos:
                raise FormatError(f"layer {i} overlaps the previous one")
            _skip(stream, e.offset - pos)
            out = wanted.pop(i, None)
            if out is not None and e.codec == CODEC_RAW:
                _read_exact(stream, out)
                check_payload(header, i, out)
            elif out is not None:
                scratch = bytearray(e.stored_len)
                _read_exact(stream, memoryview(scratch))
                decode_layer(header, i, scratch, out)
            else:
                _skip(stream, e.stored_len)
            pos = e.offset + e.stored_len
    except FormatError as e:
        log.debug("%s: rejected %s: %s", getattr(tier, "name", tier), key, e)
        _count(counters, "corrupt")
        return None
    except OSError as e:
        log.debug("%s: stream of %s failed: %s", getattr(tier, "name", tier), key, e)
        _count(counters, "misses")
        return None
    except MemoryError:
        _out_of_memory(tier, key, counters)
        return None
    finally:
        stream.close()
    _count(counters, "hits")
    return header


def read_layer(tier: Tier, key: ChunkKey, layer_idx: int, *, header: ChunkHeader | None = None,
               counters: ReadCounters | None = None) -> tuple[ChunkHeader, bytearray] | None:
    """One layer into a fresh ``bytearray`` (``[2, T, H, D]`` raw bytes), or None (a miss,
    counted; memory for the layer that cannot be had: ``oversized``)."""
    if header is None:
        header = read_header(tier, key, counters)
        if header is None:
            return None
    try:
        out = bytearray(header.layer_nbytes)
    except MemoryError:
        _out_of_memory(tier, key, counters)
        return None
    if read_layers(tier, key, [layer_idx], [out], header=header, counters=counters) is None:
        return None
    return header, out


def validate_object(obj: Buffer, key: ChunkKey) -> ChunkHeader:
    """Check a whole object (header and every layer's checksum/length) without decoding.

    Raises:
        FormatError: anything wrong with it.
    """
    view = memoryview(obj).cast("B")
    header = parse_header(view, expected_key=key)
    if header.total_bytes != view.nbytes:
        raise FormatError(f"object has {view.nbytes} bytes, header says {header.total_bytes}")
    for i, e in enumerate(header.layers):
        check_payload(header, i, view[e.offset:e.offset + e.stored_len])
    return header


def _count(counters: ReadCounters | None, name: str) -> None:
    if counters is not None:
        counters.add(name)
