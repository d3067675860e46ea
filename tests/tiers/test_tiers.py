"""The byte-tier contract, for every tier (host, disk, Redis, S3) against real services:
bit-exact round trips, idempotent puts, and bad objects read as misses with a counter."""

from __future__ import annotations

import struct

import pytest
import torch

from tests.factories import (
    BYTE_TIERS,
    as_layer,
    layer_buffers,
    make_key,
    make_kv,
    make_namespace,
    make_object,
)
from tiers.format import CODEC_LZ4, CODEC_RAW, PREFIX_BYTES, parse_header
from tiers.reader import ReadCounters, read_header, read_layer, read_layers

pytestmark = pytest.mark.cluster

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("kind", BYTE_TIERS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "lz4"])
def test_round_trip_bit_exact(make_tier, kind, dtype, compress):
    tier = make_tier(kind)
    key = make_key(1)
    kv = make_kv(dtype=dtype, compressible=compress)
    obj = make_object(key, kv, compress=compress)
    codecs = {e.codec for e in parse_header(obj).layers}
    assert codecs == ({CODEC_LZ4} if compress else {CODEC_RAW})
    assert tier.put(key, obj)
    assert tier.contains([key, make_key(2)]) == [True, False]
    assert bytes(tier.get(key)) == obj

    outs = layer_buffers(kv)
    counters = ReadCounters()
    header = read_layers(tier, key, range(kv.shape[0]), outs, counters=counters)
    assert header is not None and header.dtype == str(dtype).removeprefix("torch.")
    for i, out in enumerate(outs):
        assert torch.equal(as_layer(out, kv[i]), kv[i])
    # one layer alone, and the same bytes on a second read
    first = read_layer(tier, key, 2)
    second = read_layer(tier, key, 2)
    assert first is not None and second is not None
    assert torch.equal(as_layer(first[1], kv[2]), kv[2]) and first[1] == second[1]
    assert bytes(tier.get(key)) == obj           # reading changed nothing
    assert counters.snapshot() == {"hits": 1, "misses": 0, "corrupt": 0, "oversized": 0}


@pytest.mark.parametrize("kind", BYTE_TIERS)
def test_put_is_idempotent_first_wins(make_tier, kind):
    tier = make_tier(kind)
    key = make_key(3)
    first = make_object(key, make_kv(seed=1))
    assert tier.put(key, first)
    assert tier.put(key, make_object(key, make_kv(seed=2)))  # a later put does not rewrite
    assert bytes(tier.get(key)) == first
    assert tier.delete([key, make_key(99)]) == 1
    assert tier.contains([key]) == [False]
    assert tier.get(key) is None


@pytest.mark.parametrize("kind", BYTE_TIERS)
def test_ranges_and_misses(make_tier, kind):
    tier = make_tier(kind)
    key = make_key(4)
    obj = make_object(key, make_kv())
    tier.put(key, obj)
    got = tier.get_ranges(key, [(0, 4), (10, 6), (16, 3)])
    assert [bytes(g) for g in got] == [obj[0:4], obj[10:16], obj[16:19]]
    assert tier.get_ranges(key, [(len(obj) - 2, 4)]) is None   # past the end
    assert tier.get_ranges(make_key(5), [(0, 4)]) is None
    assert read_header(tier, make_key(5)) is None
    with pytest.raises(ValueError):
        tier.get_ranges(key, [(-1, 4)])


def _corruptions(key, obj):
    """(name, bytes stored under ``key``) of objects a reader must reject."""
    header = parse_header(obj)
    payload_at = header.layers[1].offset + 5
    flipped_payload = bytearray(obj)
    flipped_payload[payload_at] ^= 0x01
    flipped_header = bytearray(obj)
    flipped_header[PREFIX_BYTES + 3] ^= 0x20
    newer = bytearray(obj)
    struct.pack_into("<H", newer, 4, struct.unpack_from("<H", obj, 4)[0] + 1)
    foreign_key = make_key(7, namespace=make_namespace(model_id="other-model"))
    foreign = make_object(foreign_key, make_kv())           # same shape, other namespace
    same_ns_other_chunk = make_object(make_key(8), make_kv())
    return [("truncated", obj[:-7]), ("truncated_header", obj[:PREFIX_BYTES + 5]),
            ("flipped_payload", bytes(flipped_payload)), ("flipped_header", bytes(flipped_header)),
            ("newer_version", bytes(newer)), ("foreign_namespace", foreign),
            ("other_chunk", same_ns_other_chunk), ("garbage", b"\x00" * 100)]


@pytest.mark.parametrize("kind", BYTE_TIERS)
def test_bad_objects_are_misses_with_a_counter(make_tier, kind):
    tier = make_tier(kind)
    kv = make_kv()
    for i, (name, bad) in enumerate(_corruptions(make_key(6), make_object(make_key(6), kv))):
        key = make_key(100 + i)
        tier.put(key, bad)  # tiers store bytes as given; the reader is the gate
        counters = ReadCounters()
        outs = layer_buffers(kv)
        assert read_layers(tier, key, range(kv.shape[0]), outs, counters=counters) is None, name
        assert counters.snapshot()["corrupt"] == 1, name
        assert read_layer(tier, key, 1) is None, name


def test_reader_rejects_caller_mistakes(make_tier):
    tier = make_tier("host")
    key = make_key(9)
    kv = make_kv()
    tier.put(key, make_object(key, kv))
    counters = ReadCounters()                # a buffer sized for another object: a miss
    assert read_layers(tier, key, [0], [bytearray(3)], counters=counters) is None
    assert counters.snapshot()["corrupt"] == 1
    with pytest.raises(ValueError, match="read-only"):
        read_layers(tier, key, [0], [bytes(kv[0].numel() * 2)])
    with pytest.raises(ValueError):
        read_layers(tier, key, [0, 1], [bytearray(3)])
    counters = ReadCounters()
    assert read_layers(tier, key, [5], layer_buffers(kv)[:1], counters=counters) is None
    assert counters.snapshot()["corrupt"] == 1


@pytest.mark.parametrize("kind", BYTE_TIERS)
def test_put_accepts_any_buffer_and_stores_a_copy(make_tier, kind):
    import numpy as np

    tier = make_tier(kind)
    for i, wrap in enumerate((bytes, bytearray, memoryview, lambda b: np.frombuffer(b, dtype=np.uint8).copy())):
        key = make_key(200 + i)
        obj = make_object(key, make_kv(seed=i))
        buf = wrap(bytearray(obj)) if wrap is memoryview else wrap(obj)
        assert tier.put(key, buf)
        if not isinstance(buf, bytes):
            memoryview(buf).cast("B")[:] = b"\x00" * len(obj)     # the caller reuses its buffer
        assert bytes(tier.get(key)) == obj, wrap
