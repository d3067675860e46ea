"""A bounded fuzz of the object parser (``parse_header`` and ``decode_layer``): whatever the
bytes, the only exception is FormatError; plus regressions the fuzz found."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.factories import make_key, make_kv, make_object
from tiers.format import FormatError, decode_layer, parse_header
from tiers.host import HostTier

pytestmark = pytest.mark.unit

_OBJ = make_object(make_key(1), make_kv(num_layers=2, num_tokens=4), compress=False)
_OBJ_LZ4 = make_object(make_key(1), make_kv(num_layers=2, num_tokens=4, compressible=True), compress=True)


def _parse_and_decode(buf: bytes) -> None:
    try:
        header = parse_header(buf)
        for i, e in enumerate(header.layers):
            decode_layer(header, i, buf[e.offset:e.offset + e.stored_len])
    except FormatError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from([_OBJ, _OBJ_LZ4]),
       edits=st.lists(st.tuples(st.integers(0, len(_OBJ) - 1), st.integers(0, 255)), max_size=6),
       cut=st.integers(0, len(_OBJ)))
def test_fuzz_mutated_objects_raise_only_format_error(base, edits, cut):
    buf = bytearray(base[:cut])
    for pos, value in edits:
        if pos < len(buf):
            buf[pos] = value
    _parse_and_decode(bytes(buf))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_random_bytes_raise_only_format_error(data):
    _parse_and_decode(b"KVBC\x01\x00\x00\x00" + data)
    _parse_and_decode(data)


def test_fuzz_targets_reject_what_they_should():
    with pytest.raises(FormatError):
        parse_header(_OBJ[:20])
    header = parse_header(_OBJ_LZ4)
    e = header.layers[0]
    payload = bytearray(_OBJ_LZ4[e.offset:e.offset + e.stored_len])
    payload[0] ^= 1
    with pytest.raises(FormatError, match="checksum"):
        decode_layer(header, 0, bytes(payload))


def _with_valid_crc(blob: bytes, payload: bytes = b"") -> bytes:
    """A prefix whose header checksum matches ``blob``: the fuzz gets past the CRC gate."""
    import xxhash

    from tiers.format import _PREFIX, MAGIC
    from tiers.keys import FORMAT_VERSION

    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(blob), xxhash.xxh32_intdigest(blob)) + blob + payload


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
_json = st.recursive(_json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=20)
_int = st.one_of(st.integers(-3, 70), st.integers(-2**70, 2**70), _json_leaf)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.fixed_dictionaries({
    "key": st.one_of(st.just(str(make_key(1))), st.text(max_size=10)),
    "dtype": st.sampled_from(["bfloat16", "float32", "int8", "float8_e4m3fn"]),
    "num_layers": _int, "num_tokens": _int, "num_kv_heads": _int, "head_dim": _int,
    "positions": st.one_of(st.lists(st.lists(_int, max_size=3), max_size=3), _json),
    "layers": st.one_of(st.lists(st.lists(_int, min_size=4, max_size=6), max_size=3), _json),
}), payload=st.binary(max_size=300), raw_json=st.one_of(st.none(), st.binary(max_size=60)))
def test_fuzz_headers_with_valid_checksum(header, payload, raw_json):
    import json

    blob = raw_json if raw_json is not None else json.dumps(header).encode()
    _parse_and_decode(_with_valid_crc(blob, payload))


def test_fuzz_findings_are_format_errors():
    # found by the fuzz above: int(1e400) overflowed, and deep nesting recursed
    for blob in (b'{"num_tokens": 1e400}', b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(FormatError, match="malformed"):
            parse_header(_with_valid_crc(blob))


def test_implausible_header_claims_are_misses():
    import json

    from tiers.reader import ReadCounters, read_header

    key = make_key(1)
    host = HostTier(1 << 20)
    huge = {"key": str(key), "dtype": "float32", "num_layers": 1, "num_tokens": 2**40,
            "num_kv_heads": 1, "head_dim": 1, "positions": [[0, 2**40]],
            "layers": [[10**6, 10, 2**43, 1, 0]]}        # an lz4 "bomb" claiming 8 TiB
    obj = _with_valid_crc(json.dumps(huge).encode(), b"\0" * 64)
    with pytest.raises(FormatError, match="outside the limits"):  # well-formed JSON, refused
        parse_header(obj)                                           # by parse_header's bounds
    host.put(key, obj)
    counters = ReadCounters()
    assert read_header(host, key, counters) is None
    assert counters.snapshot()["corrupt"] == 1
