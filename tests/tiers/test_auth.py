"""Authenticated chunk objects (tiers.auth, issue #19 item 5): with an object key set, an
object without a valid MAC (planted with valid checksums, signed under another key, or with
a forged header or layer) is a miss and counted, never KV; the signed round trip is
bit-exact; a process without a key reads signed objects; the key is never shown."""

from __future__ import annotations

import pytest
import xxhash

from tests.factories import (
    OBJECT_KEY_A,
    OBJECT_KEY_B,
    as_layer,
    layer_buffers,
    make_key,
    make_kv,
    make_object,
    object_keys,
)
from tiers import auth
from tiers.disk import DiskTier
from tiers.format import (
    FLAG_MAC,
    PREFIX_BYTES,
    AuthError,
    FormatError,
    check_payload,
    decode_layer,
    parse_header,
    rewrite_header,
)
from tiers.host import HostTier
from tiers.reader import ReadCounters, read_layers, validate_object
from tiers.stack import TierStack

pytestmark = pytest.mark.unit

KEY_A, KEY_B = OBJECT_KEY_A, OBJECT_KEY_B


@pytest.fixture
def use_key():
    """``use_key(k)``: this process signs and checks under ``k`` (None: no key) until the test ends."""
    with object_keys() as use:
        yield use


def _read_all(tier, key, kv, counters=None):
    outs = layer_buffers(kv)
    got = read_layers(tier, key, range(kv.shape[0]), outs, counters=counters)
    return None if got is None else outs


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "lz4"])
def test_signed_objects_round_trip_bit_exact_and_carry_tags(use_key, tmp_path, compress):
    use_key(KEY_A)
    key, kv = make_key(1), make_kv(1, compressible=compress)
    obj = make_object(key, kv, compress=compress)
    header = parse_header(obj, expected_key=key)
    assert obj[6] & FLAG_MAC and len(header.nonce) == auth.NONCE_BYTES
    assert all(len(e.tag) == auth.TAG_BYTES for e in header.layers)
    disk = DiskTier(str(tmp_path), 1 << 20, fsync=False)
    assert disk.put(key, obj)
    outs = _read_all(disk, key, kv)
    assert outs is not None and all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    # the same chunk encoded twice: fresh nonces, so no one-time key tags two payloads
    assert parse_header(make_object(key, kv, compress=compress)).nonce != header.nonce


def test_a_planted_object_with_valid_checksums_and_no_mac_is_a_counted_miss(use_key, tmp_path):
    key, kv = make_key(2), make_kv(2)
    planted = make_object(key, kv)           # no key in this process: checksums only
    validate_object(planted, key)            # a valid object by every unkeyed check
    use_key(KEY_A)
    disk = DiskTier(str(tmp_path), 1 << 20, fsync=False)
    assert disk.put(key, planted)            # whoever can write the directory
    counters = ReadCounters()
    assert _read_all(disk, key, kv, counters) is None
    assert counters.snapshot()["corrupt"] == 1 and counters.snapshot()["hits"] == 0
    with pytest.raises(AuthError):
        validate_object(planted, key)
    # through the stack the shards run: no tier serves it, none promotes it to host memory
    host = HostTier(1 << 20)
    stack = TierStack([host, DiskTier(str(tmp_path / "s"), 1 << 20, fsync=False)], write_down=())
    stack.tiers[1].put(key, planted)
    assert stack.find(key) is None and stack.read_layers(key, range(kv.shape[0]), layer_buffers(kv)) is None
    assert host.get(key) is None


def test_an_object_signed_under_another_key_is_a_miss(use_key):
    key, kv = make_key(3), make_kv(3)
    use_key(KEY_B)
    other = make_object(key, kv)
    use_key(KEY_A)
    with pytest.raises(AuthError, match="header tag"):
        parse_header(other, expected_key=key)
    assert _read_all(_Bytes(key, other), key, kv) is None


def test_a_forged_header_or_layer_fails_its_tag(use_key):
    use_key(KEY_A)
    key, kv = make_key(4), make_kv(4)
    obj = make_object(key, kv)
    header = parse_header(obj, expected_key=key)
    # the header edited with every checksum recomputed (rewrite_header keeps the old tag)
    with pytest.raises(AuthError):
        parse_header(rewrite_header(obj, positions=[[5, kv.shape[2]]]), expected_key=key)
    # a layer replaced by other bytes whose XXH3 matches (as if it collided): the tag fails
    e = header.layers[0]
    forged = bytearray(obj[e.offset:e.offset + e.stored_len])
    forged[0] ^= 0xFF
    collided = header.layers[0].__class__(e.offset, e.stored_len, e.raw_len, e.codec,
                                          xxhash.xxh3_64_intdigest(forged), e.tag)
    forged_header = header.__class__(**{**header.__dict__, "layers": (collided, *header.layers[1:])})
    with pytest.raises(AuthError, match="layer 0"):
        check_payload(forged_header, 0, forged)
    with pytest.raises(AuthError):
        decode_layer(forged_header, 0, forged)
    # host memory is authenticated on entry: readers of it may skip the tag, not the XXH3
    decode_layer(forged_header, 0, forged, authenticate=False)
    with pytest.raises(FormatError, match="checksum"):
        decode_layer(header, 0, forged, authenticate=False)


def test_a_process_without_a_key_reads_signed_objects(use_key):
    key, kv = make_key(5), make_kv(5)
    use_key(KEY_A)
    obj = make_object(key, kv)
    use_key(None)
    outs = _read_all(_Bytes(key, obj), key, kv)
    assert outs is not None and all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    assert parse_header(obj).header_end > PREFIX_BYTES + auth.TAG_BYTES


class _Bytes:
    """A one-object read-only tier (``get``/``get_ranges``) over given bytes."""

    name = "bytes"

    def __init__(self, key, obj: bytes) -> None:
        self.key, self.obj = key, obj

    def get(self, key):
        return memoryview(self.obj) if key == self.key else None

    def get_ranges(self, key, ranges):
        if key != self.key:
            return None
        return [memoryview(self.obj)[o:o + n] for o, n in ranges]
