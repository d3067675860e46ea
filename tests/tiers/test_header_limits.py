"""One validator for every size a chunk header states (tiers.format.parse_header), so every
parse path (tiers.reader, the Ray client, the machine-local client, the shard's
validate_object) refuses a header before anything is allocated for it, and a read that runs
out of memory is a miss, not an exception (issue #20: "bad headers allocate what they claim").
"""

from __future__ import annotations

import pytest

from tests.factories import forge_header as forge
from tests.factories import layer_buffers, make_key, make_kv, make_object, make_prefix_key
from tiers.format import MAX_TOKENS, FormatError, parse_header
from tiers.reader import ReadCounters, read_header, read_layers
from tiers.tier import MemoryTier

pytestmark = pytest.mark.unit


@pytest.fixture
def chunk():
    key, kv = make_key(7), make_kv(7, num_tokens=4)
    return key, make_object(key, kv), kv


def test_forge_keeps_a_valid_object_valid(chunk):
    key, obj, kv = chunk
    header = parse_header(forge(obj, positions=[[0, 4]]), expected_key=key)
    assert header.num_tokens == 4 and header.position_list() == [0, 1, 2, 3]
    tier = MemoryTier(2**20)
    pkey = make_prefix_key(7)  # a prefix chunk's KV may sit at any positions
    tier.put(pkey, forge(make_object(pkey, kv), positions=[[10, 2], [20, 2]]))
    outs = layer_buffers(kv)
    assert read_layers(tier, pkey, range(kv.shape[0]), outs) is not None  # the bytes still check out


@pytest.mark.parametrize("runs", [[[5, 4]], [[1, 4]], [[0, 2], [2, 2]], [[0, 3], [9, 1]]])
def test_a_segment_objects_positions_must_be_canonical(chunk, runs):
    """#37: a segment's KV is computed alone at 0..T-1; an unsigned object claiming other
    positions (``[[5, 4]]``) would have the blend rotate it from where it never was."""
    key, obj, _ = chunk
    with pytest.raises(FormatError, match="non-canonical position runs"):
        parse_header(forge(obj, positions=runs), expected_key=key)


def test_a_prefix_objects_runs_must_be_merged_as_written():
    key = make_prefix_key(7)
    obj = make_object(key, make_kv(7, num_tokens=4))
    assert parse_header(forge(obj, positions=[[5, 4]]), expected_key=key).position_list() == [5, 6, 7, 8]
    with pytest.raises(FormatError, match="non-canonical position runs"):
        parse_header(forge(obj, positions=[[5, 2], [7, 2]]), expected_key=key)


def _lz4_object(key):
    return make_object(key, make_kv(8, num_layers=2, num_tokens=64, num_kv_heads=4, head_dim=64,
                                    compressible=True), compress=True)


def test_an_lz4_layer_claiming_a_gib_is_a_miss_without_allocating_it():
    """#37: an lz4 layer claiming stored_len = 1 GiB for a small layer: refused on parse, so
    no read path allocates its scratch (every tier kind reads through tiers.reader)."""
    import tracemalloc

    key = make_key(8)
    obj = _lz4_object(key)
    header = parse_header(obj, expected_key=key)
    assert header.layers[0].codec == 1
    layers = [[e.offset, 1 << 30, e.raw_len, e.codec, e.checksum] for e in header.layers]
    forged = forge(obj, layers=layers)
    tier = _IntoTier(2**20)  # reads into scratch buffers sized from the header, as S3 does
    tier.put(key, forged)
    counters = ReadCounters()
    outs = [bytearray(header.layer_nbytes) for _ in range(2)]
    tracemalloc.start()
    try:
        assert read_layers(tier, key, [0, 1], outs, counters=counters) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20 and counters.values["corrupt"] == 1
    with pytest.raises(FormatError, match="implausible lengths"):
        parse_header(forged, expected_key=key)


class _IntoTier(MemoryTier):
    """A memory tier with ``get_ranges_into`` (the S3 tier's streaming read)."""

    def get_ranges_into(self, key, ranges, outs):
        got = self.get_ranges(key, ranges)
        if got is None:
            return False
        for src, dst in zip(got, outs, strict=True):
            memoryview(dst).cast("B")[:] = src
        return True


def test_offsets_past_the_object_the_header_describes_are_refused():
    key = make_key(8)
    obj = _lz4_object(key)
    header = parse_header(obj, expected_key=key)
    far = [[e.offset + (1 << 40), e.stored_len, e.raw_len, e.codec, e.checksum] for e in header.layers]
    with pytest.raises(FormatError, match="past the object"):
        parse_header(forge(obj, layers=far), expected_key=key)


@pytest.mark.parametrize("runs", [
    [[0, 10_000_000], [0, -9_999_996]],     # sums to 4, expands to 10M positions
    [[0, 5], [9, -1]],                      # a negative run
    [[0, 2], [5, 0], [6, 2]],               # an empty run
    [[-3, 4]],                              # a negative start
])
def test_position_runs_that_expand_past_num_tokens_are_refused(chunk, runs):
    key, obj, _ = chunk
    with pytest.raises(FormatError, match="position runs"):
        parse_header(forge(obj, positions=runs), expected_key=key)


@pytest.mark.parametrize("changes,match", [
    ({"num_kv_heads": 1 << 28}, "bytes per layer"),           # 4 tokens claiming a 4 GiB layer
    ({"num_tokens": MAX_TOKENS + 1, "positions": [[0, MAX_TOKENS + 1]]}, "outside the limits"),
    ({"head_dim": 0}, "outside the limits"),
    ({"num_layers": 0, "layers": []}, "outside the limits"),
])
def test_sizes_over_the_limits_are_refused_on_parse(chunk, changes, match):
    key, obj, _ = chunk
    with pytest.raises(FormatError, match=match):
        parse_header(forge(obj, **changes), expected_key=key)


def test_an_lz4_layer_claiming_huge_scratch_is_refused():
    """A 64 KiB layer said to be lz4 in 1 stored byte: lz4 cannot expand that far."""
    key = make_key(8)
    obj = make_object(key, make_kv(8, num_layers=2, num_tokens=64, num_kv_heads=4, head_dim=64))
    header = parse_header(obj, expected_key=key)
    assert header.layer_nbytes == 64 * 1024
    layers = [[e.offset, 1, e.raw_len, 1, e.checksum] for e in header.layers]
    with pytest.raises(FormatError, match="implausible lengths"):
        parse_header(forge(obj, layers=layers), expected_key=key)


def test_read_header_counts_a_forged_header_as_corrupt(chunk):
    key, obj, _ = chunk
    tier = MemoryTier(2**20)
    tier.put(key, forge(obj, positions=[[0, 10_000_000], [0, -9_999_996]]))
    counters = ReadCounters()
    assert read_header(tier, key, counters=counters) is None
    assert counters.values["corrupt"] == 1


class _OutOfMemoryTier(MemoryTier):
    def get_ranges(self, key, ranges):
        raise MemoryError


def test_out_of_memory_during_a_read_is_a_miss(chunk):
    key, obj, kv = chunk
    tier = _OutOfMemoryTier(2**20)
    tier.put(key, obj)
    header = parse_header(obj, expected_key=key)
    counters = ReadCounters()
    assert read_layers(tier, key, [0], layer_buffers(kv)[:1], header=header, counters=counters) is None
    assert counters.values["oversized"] == 1  # a counted miss (#37), never an exception


class _OutOfMemoryHead(MemoryTier):
    def head(self, key, max_bytes):
        raise MemoryError


class _OutOfMemoryStream(MemoryTier):
    """A tier that serves whole-object streams (as S3 does) whose reads run out of memory."""

    def open_stream(self, key):
        class Stream:
            def readinto(self, buf):
                raise MemoryError

            def close(self):
                pass

        return Stream() if self.contains([key])[0] else None


@pytest.mark.parametrize("tier_cls", [_OutOfMemoryHead, _OutOfMemoryStream])
def test_out_of_memory_on_every_read_path_is_a_counted_miss(chunk, tier_cls):
    """#37: a MemoryError from the header probe or the S3-style stream escaped read_layers."""
    key, obj, kv = chunk
    tier = tier_cls(2**20)
    tier.put(key, obj)
    counters = ReadCounters()
    assert read_layers(tier, key, range(kv.shape[0]), layer_buffers(kv), counters=counters) is None
    assert counters.values["oversized"] == 1
