"""Chunk keys and the chunk object format: stable hashes, bit-exact round trips, misses."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from cluster.cache.local import LocalCacheClient
from tiers.codec import encode_kv
from tiers.format import FormatError, decode_layer, encode_chunk, parse_header
from tiers.keys import ChunkKey, Namespace, prefix_keys, segment_key

NS = Namespace("m", "fp", "bfloat16", 2, 2, 4).digest()


def test_segment_key_is_position_independent_and_stable_across_processes():
    ids = [5, 6, 7, 8]
    k = segment_key(NS, ids)
    assert k == segment_key(NS, list(ids)) and k != segment_key(NS, ids[::-1])
    code = f"from tiers.keys import segment_key; print(segment_key({NS!r}, {ids}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, check=True).stdout.strip()
    assert out == str(k)
    assert ChunkKey.parse(str(k)) == k


def test_prefix_keys_are_chained():
    a = prefix_keys(NS, list(range(10)), 4)
    b = prefix_keys(NS, [99] + list(range(1, 10)), 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # change in chunk 0 changes chunk 1's key
    assert prefix_keys(NS, list(range(8)), 4) == a


def test_namespace_changes_with_anything_that_changes_kv():
    base = Namespace("m", "fp", "bfloat16", 2, 2, 4)
    variants = [Namespace("m", "fp", "float16", 2, 2, 4), Namespace("m", "fp2", "bfloat16", 2, 2, 4),
                Namespace("m", "fp", "bfloat16", 2, 2, 4, tp_rank=1, tp_size=2),
                Namespace("m", "fp", "bfloat16", 2, 2, 4, rope="theta=1"),
                Namespace("m", "fp", "bfloat16", 2, 2, 4, lora="a")]
    assert len({base.digest(), *[v.digest() for v in variants]}) == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_bit_exact(dtype, compress):
    key = segment_key(NS, [1, 2, 3])
    kv = torch.randn(3, 2, 5, 2, 4).to(dtype)
    kv[1] = 0  # a compressible layer
    client = LocalCacheClient(compress=compress)
    client.put(key, kv, positions=[7, 8, 9, 10, 11])
    meta = client.lookup([key])[0]
    assert meta.num_tokens == 5 and meta.positions == (7, 8, 9, 10, 11)
    for layer in range(3):
        got = client.fetch_layer([key], layer).result()[0]
        assert got.dtype == dtype and torch.equal(got, kv[layer])
    if compress:
        h = parse_header(encode_kv(key, kv, compress=True))
        assert h.layers[1].codec == 1  # zeros compress
        assert h.layers[0].codec == 0  # random bf16/fp32 does not shrink 1.1x: stored raw


def test_corruption_truncation_foreign_key_are_format_errors():
    key = segment_key(NS, [1])
    obj = bytearray(encode_chunk(key, [np.arange(16, dtype=np.uint8).tobytes()], dtype="float32",
                                 num_tokens=1, num_kv_heads=1, head_dim=2))
    h = parse_header(bytes(obj), expected_key=key)
    with pytest.raises(FormatError):
        parse_header(bytes(obj), expected_key=segment_key(NS, [2]))
    with pytest.raises(FormatError):
        parse_header(bytes(obj[:20]))
    flipped = bytearray(obj)
    flipped[-1] ^= 1
    e = h.layers[0]
    with pytest.raises(FormatError):
        decode_layer(h, 0, bytes(flipped[e.offset:e.offset + e.stored_len]))
    newer = bytearray(obj)
    newer[4] = 99
    with pytest.raises(FormatError):
        parse_header(bytes(newer))


def test_corrupted_object_is_a_miss_not_an_exception():
    key = segment_key(NS, [1, 2])
    client = LocalCacheClient()
    client.put(key, torch.randn(2, 2, 2, 2, 4, dtype=torch.bfloat16))
    stored = client.tier._data[key]
    client.tier._data[key] = stored[:-3]  # truncated payload
    assert client.fetch_layer([key], 1).result() == [None]
    client.tier._data[key] = b"garbage" * 10
    assert client.lookup([key]) == [None]
    assert client.counters["read_errors"] >= 1
