"""The chunk object format: one self-describing, layer-addressable byte object per chunk.

Layout (all integers little-endian)::

    | prefix (16 B) | header (JSON, header_len B) | layer 0 payload | layer 1 payload | ... |

    prefix  = magic b"KVBC" | version u16 | flags u16 | header_len u32 | header_xxh32 u32
    header  = {"key": "<ns>/<kind>/<hash>", "dtype": "bfloat16", "num_layers": L,
               "num_tokens": T, "num_kv_heads": H, "head_dim": D,
               "positions": [[start, length], ...],          # runs; K was rotated at these
               "layers": [[offset, stored_len, raw_len, codec, xxh64], ...]}   # one per layer

With a key set (:mod:`tiers.auth`), ``flags`` has :data:`FLAG_MAC`, the header also holds
``"nonce": "<32 hex>"``, each layer entry a sixth item, its Poly1305 tag (32 hex), and the
header region (``header_len`` bytes, all covered by ``header_xxh32``) ends with the header's
16-byte BLAKE2b tag after the JSON. Version 2 added the tags; objects of version 1 are misses
(their keys' namespaces differ too) that ``kvblend clear --stale`` deletes (:mod:`tiers.ownership`).

A layer's raw payload is the layer's K and V, ``[2, T, H, D]`` (axis 0: K then V) in
``dtype``, C-contiguous. ``codec`` is 0 (raw) or 1 (lz4 block); a layer is compressed only
when lz4 shrinks it by at least :data:`MIN_LZ4_RATIO`. ``xxh64`` is XXH3-64 of the stored
payload, checked before decompressing. Offsets count from the start of the object, so a
reader fetches the prefix and header (:data:`HEADER_PROBE_BYTES` covers them for models up to
hundreds of layers) and then exactly the layers it needs.

One chunk has several encodings: raw in memory tiers, lz4 below memory, and a copy written
again (evicted, then re-put by a process with another ``compression``) may differ from the
one it replaced. The KV is the same; offsets and checksums are not. A reader slices an object
only with the header of that same object (a cached header that fails its checksums is
re-read, not taken for corruption).

Never pickle. Anything truncated, corrupted, of another version or of another namespace is
reported as :class:`FormatError` by the parsers here and turned into a miss (plus a counter)
by :func:`read_layers`; callers never see an exception or wrong bytes from a bad object.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import lz4.block
import numpy as np
import xxhash

from tiers import auth
from tiers.keys import FORMAT_VERSION, SEGMENT, ChunkKey

MAGIC = b"KVBC"
_PREFIX = struct.Struct("<4sHHII")
PREFIX_BYTES = _PREFIX.size  # 16
HEADER_PROBE_BYTES = 16384
MAX_HEADER_BYTES = 1 << 24
MIN_LZ4_RATIO = 1.1
CODEC_RAW = 0
CODEC_LZ4 = 1
#: prefix flag: the header ends with a BLAKE2b tag and every layer entry carries a Poly1305 tag
FLAG_MAC = 1

#: Hard limits on what a header may claim, checked by :func:`parse_header` before anything is
#: allocated for it (a 7B model's layer of 256 tokens is 1 MiB; 1 GiB is a 32k-token segment of
#: a model with 16 KV heads of 256 dims in fp32). A header over them is corrupt.
MAX_LAYER_BYTES = 1 << 30
MAX_TOKENS = 1 << 22
MAX_LAYERS = 1024
#: lz4's block format expands at most ~255x; a raw length claimed beyond it is corrupt.
MAX_LZ4_EXPANSION = 256

#: bytes per element of the dtypes we store
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


class FormatError(Exception):
    """A chunk object is truncated, corrupted, foreign or of another version."""


class AuthError(FormatError):
    """A chunk object without a valid MAC, read by a process that has an object key."""


@dataclass(frozen=True)
class LayerEntry:
    offset: int
    stored_len: int
    raw_len: int
    codec: int
    checksum: int
    tag: bytes = b""  # Poly1305 tag of the stored payload (authenticated objects only)


@dataclass(frozen=True)
class ChunkHeader:
    """Parsed header of a chunk object.

    Shapes: each layer's raw payload is ``[2, num_tokens, num_kv_heads, head_dim]``.
    """

    key: str
    dtype: str
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    positions: tuple[tuple[int, int], ...]
    layers: tuple[LayerEntry, ...]
    header_end: int
    nonce: bytes = b""  # per-object random nonce of the layer tags (authenticated objects only)

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        return (2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def layer_nbytes(self) -> int:
        return 2 * self.num_tokens * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def total_bytes(self) -> int:
        return max((e.offset + e.stored_len for e in self.layers), default=self.header_end)

    def position_list(self) -> list[int]:
        """Token positions K was rotated at, one per token."""
        out: list[int] = []
        for start, length in self.positions:
            out.extend(range(start, start + length))
        return out


def positions_to_runs(positions: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in positions:
        p = int(p)
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return runs


def encode_chunk(
    key: ChunkKey,
    layers: Sequence[bytes | bytearray | memoryview],
    *,
    dtype: str,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    positions: Sequence[int] | None = None,
    compress: bool = False,
) -> bytes:
    """Encode one chunk's per-layer KV into a chunk object.

    Args:
        key: the chunk's key (stored in the header and checked by readers).
        layers: per layer, the raw bytes of ``[2, T, H, D]`` (K then V) in ``dtype``.
        positions: token positions K was rotated at (default ``0..T-1``, canonical KV).
        compress: try lz4 per layer (kept only where it shrinks by :data:`MIN_LZ4_RATIO`).

    Returns:
        The object's bytes.

    Raises:
        ValueError: unknown dtype, a layer of the wrong size, or positions of the wrong length.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} not supported; one of {sorted(DTYPE_BYTES)}")
    raw_len = 2 * num_tokens * num_kv_heads * head_dim * DTYPE_BYTES[dtype]
    if positions is None:
        positions = range(num_tokens)
    if len(positions) != num_tokens:
        raise ValueError(f"{len(positions)} positions for {num_tokens} tokens")
    payloads: list[bytes | memoryview] = []
    entries: list[list[int]] = []
    for i, layer in enumerate(layers):
        mv = memoryview(layer).cast("B")
        if mv.nbytes != raw_len:
            raise ValueError(f"layer {i} has {mv.nbytes} bytes, expected {raw_len} for "
                             f"[2, {num_tokens}, {num_kv_heads}, {head_dim}] {dtype}")
        codec, stored = CODEC_RAW, mv
        if compress:
            packed = lz4.block.compress(mv, store_size=False)
            if len(packed) * MIN_LZ4_RATIO <= raw_len:
                codec, stored = CODEC_LZ4, packed
        payloads.append(stored)
        entries.append([0, len(stored), raw_len, codec, xxhash.xxh3_64_intdigest(stored)])
    header = {"key": str(key), "dtype": dtype, "num_layers": len(payloads),
              "num_tokens": num_tokens, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
              "positions": positions_to_runs(positions), "layers": entries}
    signer = auth.current()
    tag_bytes = 0
    if signer is not None:
        nonce = signer.new_nonce()
        header["nonce"] = nonce.hex()
        for i, (e, p) in enumerate(zip(entries, payloads, strict=True)):
            e.append(signer.layer_tag(nonce, i, p).hex())
        tag_bytes = auth.TAG_BYTES
    # Offsets depend on the header's length, which depends on the offsets' digits: fix the
    # point by padding offsets to a generous width first.
    for e in entries:
        e[0] = 10**15
    blob_len = len(json.dumps(header, separators=(",", ":")).encode())
    offset = PREFIX_BYTES + blob_len + tag_bytes
    for e, p in zip(entries, payloads, strict=True):
        e[0] = offset
        offset += len(p)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob = blob + b" " * (blob_len - len(blob))  # pad back to the reserved length
    if signer is None:
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(blob), xxhash.xxh32_intdigest(blob))
        return b"".join([prefix, blob, *payloads])
    prefix12 = struct.pack("<4sHHI", MAGIC, FORMAT_VERSION, FLAG_MAC, len(blob) + tag_bytes)
    region = blob + signer.header_tag(prefix12, blob)
    return b"".join([prefix12, struct.pack("<I", xxhash.xxh32_intdigest(region)), region, *payloads])


def parse_prefix(buf: bytes | memoryview) -> int:
    """Return header_len from the 16-byte prefix. Raises FormatError."""
    if len(buf) < PREFIX_BYTES:
        raise FormatError("truncated prefix")
    magic, version, _flags, header_len, _crc = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, expected {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES:
        raise FormatError(f"header length {header_len} too large")
    return header_len


def parse_header(buf: bytes | memoryview, expected_key: ChunkKey | None = None) -> ChunkHeader:
    """Parse and validate the prefix and header at the start of ``buf``.

    Every parse path (tiers.reader, both cache clients, the shard's ``validate_object``)
    comes through here, so no caller allocates for a header that :func:`_check_sizes` has not
    checked against the hard limits (:data:`MAX_TOKENS`, :data:`MAX_LAYER_BYTES`,
    :data:`MAX_LAYERS`, :data:`MAX_LZ4_EXPANSION`).

    Raises:
        FormatError: truncated, corrupted, another version, sizes inconsistent or over the
            limits (an lz4 layer longer than its raw size, an offset past the end of the object
            the header describes), position runs that are not canonical (adjacent runs unmerged;
            a segment's other than ``[[0, num_tokens]]``), or (with ``expected_key``) a header
            naming another key or namespace.
    """
    header_len = parse_prefix(buf)
    end = PREFIX_BYTES + header_len
    if len(buf) < end:
        raise FormatError("truncated header")
    blob = bytes(buf[PREFIX_BYTES:end])
    _, _, flags, _, crc = _PREFIX.unpack_from(buf, 0)
    if xxhash.xxh32_intdigest(blob) != crc:
        raise FormatError("header checksum mismatch")
    signed = bool(flags & FLAG_MAC)
    checker = auth.current()
    if signed:
        if header_len < auth.TAG_BYTES:
            raise FormatError("truncated header tag")
        blob, tag = blob[:-auth.TAG_BYTES], blob[-auth.TAG_BYTES:]
        if checker is not None and not checker.header_ok(bytes(buf[:12]), blob, tag):
            raise AuthError("header tag mismatch")
    elif checker is not None:
        raise AuthError("object without a MAC (an object key is set)")
    try:
        h = json.loads(blob)
        layers = tuple(_layer_entry(e, signed) for e in h["layers"])
        header = ChunkHeader(
            key=str(h["key"]), dtype=str(h["dtype"]), num_layers=int(h["num_layers"]),
            num_tokens=int(h["num_tokens"]), num_kv_heads=int(h["num_kv_heads"]),
            head_dim=int(h["head_dim"]),
            positions=tuple((int(a), int(b)) for a, b in h["positions"]),
            layers=layers, header_end=end, nonce=bytes.fromhex(h["nonce"]) if signed else b"")
        if signed and len(header.nonce) != auth.NONCE_BYTES:
            raise ValueError(f"nonce of {len(header.nonce)} bytes")
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
        # OverflowError: a number like 1e400 (int(inf)); RecursionError: deeply nested JSON
        raise FormatError(f"malformed header: {type(e).__name__}: {str(e)[:200]}") from None
    _check_sizes(header)
    if expected_key is not None and header.key != str(expected_key):
        raise FormatError(f"object holds {header.key}, expected {expected_key}")
    return header


def _layer_entry(e, signed: bool) -> LayerEntry:
    """One ``layers`` item: five integers, and a 16-byte hex tag when ``signed``.
    Raises ValueError/TypeError when it is not that."""
    if len(e) != 5 + signed:
        raise ValueError(f"layer entry of {len(e)} items")
    tag = bytes.fromhex(e[5]) if signed else b""
    if signed and len(tag) != auth.TAG_BYTES:
        raise ValueError(f"layer tag of {len(tag)} bytes")
    return LayerEntry(*map(int, e[:5]), tag)


def check_payload(header: ChunkHeader, layer_idx: int, payload, *, authenticate: bool = True) -> None:
    """Check one layer's stored payload: its Poly1305 tag when this process has an object key
    and ``authenticate`` (False only for bytes read from host memory, which were authenticated
    when they entered it), else its XXH3-64. Lengths are the caller's to check.

    Raises:
        FormatError: checksum mismatch; AuthError: tag mismatch or missing.
    """
    e = header.layers[layer_idx]
    checker = auth.current() if authenticate else None
    if checker is not None:  # the tag catches every change the XXH3 would: one pass, not two
        if not (e.tag and checker.layer_ok(header.nonce, layer_idx, payload, e.tag)):
            raise AuthError(f"layer {layer_idx}: tag mismatch")
    elif xxhash.xxh3_64_intdigest(payload) != e.checksum:
        raise FormatError(f"layer {layer_idx}: checksum mismatch")


def _check_sizes(header: ChunkHeader) -> None:
    """Every size a header states, against itself and the hard limits above, before any
    caller allocates for it (layer buffers, decompression scratch, the position list).

    Raises:
        FormatError: naming the first claim that is inconsistent or over a limit.
    """
    if header.dtype not in DTYPE_BYTES or header.num_layers != len(header.layers):
        raise FormatError("inconsistent header")
    if not (0 < header.num_layers <= MAX_LAYERS and 0 < header.num_tokens <= MAX_TOKENS
            and header.num_kv_heads > 0 and header.head_dim > 0):
        raise FormatError(f"header claims {header.num_layers} layers, {header.num_tokens} tokens, "
                          f"{header.num_kv_heads} heads of {header.head_dim}: outside the limits")
    if header.layer_nbytes > MAX_LAYER_BYTES:
        raise FormatError(f"header claims {header.layer_nbytes} bytes per layer, over {MAX_LAYER_BYTES}")
    # runs of positive length and non-negative start, so expanding them (position_list) makes
    # exactly num_tokens entries: a run of 10M tokens cancelled by a negative one is refused
    if len(header.positions) > header.num_tokens or any(
            start < 0 or length <= 0 for start, length in header.positions):
        raise FormatError("malformed position runs")
    if sum(length for _, length in header.positions) != header.num_tokens:
        raise FormatError("positions do not cover num_tokens")
    # canonical runs, as positions_to_runs writes them: no run starts where the one before
    # ended; a segment's KV is canonical (computed alone at 0..T-1), so its runs are [[0, T]]
    if any(a + n == b for (a, n), (b, _) in zip(header.positions, header.positions[1:], strict=False)):
        raise FormatError("non-canonical position runs")
    if header.key.split("/")[1:2] == [SEGMENT] and header.positions != ((0, header.num_tokens),):
        raise FormatError(f"non-canonical position runs of a segment: {list(header.positions[:3])}")
    # offsets within the object the header describes: header, then the stored layers
    length = header.header_end + sum(e.stored_len for e in header.layers)
    for i, e in enumerate(header.layers):
        if e.raw_len != header.layer_nbytes or e.codec not in (CODEC_RAW, CODEC_LZ4) or e.offset < header.header_end:
            raise FormatError("inconsistent layer entry")
        if e.codec == CODEC_RAW and e.stored_len != e.raw_len:
            raise FormatError("inconsistent raw layer length")
        # an lz4 layer is stored only where it shrinks (MIN_LZ4_RATIO): its scratch is at most
        # the raw size the shape allows, never what stored_len claims beyond it
        if not 0 < e.stored_len <= e.raw_len or e.raw_len > MAX_LZ4_EXPANSION * e.stored_len + 64:
            raise FormatError(f"layer {i}: implausible lengths {e.stored_len}/{e.raw_len}")
        if e.offset + e.stored_len > length:
            raise FormatError(f"layer {i}: offset {e.offset} past the object's {length} bytes")


def decode_layer(header: ChunkHeader, layer_idx: int, payload: bytes | memoryview,
                 out: memoryview | None = None, *, verify: bool = True,
                 authenticate: bool = True) -> memoryview:
    """Check and decode one layer's stored payload.

    Args:
        out: optional writable buffer of ``header.layer_nbytes`` bytes to fill (copied into
            with numpy, which releases the GIL: io threads copy layers in parallel).
        verify: check the payload's XXH3 (False only for bytes whose XXH3 against this very
            header entry was checked when they entered memory).
        authenticate: with ``verify``, also its tag when a key is set (:func:`check_payload`;
            False for bytes read from host memory).

    Returns:
        The raw ``[2, T, H, D]`` bytes (``out`` when given; else a view of ``payload`` for a
        raw layer, or fresh bytes for an lz4 layer).

    Raises:
        FormatError: length or checksum mismatch, or an lz4 stream that does not decode;
            AuthError: a tag that does not match.
    """
    e = header.layers[layer_idx]
    if len(payload) != e.stored_len:
        raise FormatError(f"layer {layer_idx}: {len(payload)} bytes, expected {e.stored_len}")
    if verify:
        check_payload(header, layer_idx, payload, authenticate=authenticate)
    if e.codec == CODEC_LZ4:
        try:
            raw = lz4.block.decompress(payload, uncompressed_size=e.raw_len)
        except lz4.block.LZ4BlockError as err:
            raise FormatError(f"layer {layer_idx}: lz4: {err}") from None
        if len(raw) != e.raw_len:
            raise FormatError(f"layer {layer_idx}: decompressed to {len(raw)} bytes")
    else:
        raw = payload
    if out is None:
        return memoryview(raw)
    out = memoryview(out).cast("B")
    if out.nbytes != e.raw_len:
        raise ValueError(f"out has {out.nbytes} bytes, expected {e.raw_len}")
    np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(raw, dtype=np.uint8))
    return out


def rewrite_header(obj: bytes | memoryview, **changes) -> bytes:
    """``obj`` (a chunk object) with header fields replaced and the rest kept consistent: the
    prefix's length and checksum recomputed, layer offsets (the given ``layers`` or the
    object's) shifted by the header's change in length, payloads unchanged. Nothing is
    validated: this forges objects for fault injection (:mod:`cluster.workloads.faults`) and
    tests, never on the serving path."""
    obj = bytes(obj)
    magic, version, flags, header_len, _ = _PREFIX.unpack_from(obj, 0)
    end = PREFIX_BYTES + header_len
    tag = obj[end - auth.TAG_BYTES:end] if flags & FLAG_MAC else b""  # kept: now it fails
    header = {**json.loads(obj[PREFIX_BYTES:end - len(tag)]), **changes}
    layers, delta = header["layers"], 0
    while True:  # offsets move with the header's length, whose digits they change in turn
        header["layers"] = [[e[0] + delta, *e[1:]] for e in layers]
        blob = json.dumps(header, separators=(",", ":")).encode() + tag
        if len(blob) - header_len == delta:
            break
        delta = len(blob) - header_len
    prefix = _PREFIX.pack(magic, version, flags, len(blob), xxhash.xxh32_intdigest(blob))
    return prefix + blob + obj[end:]
