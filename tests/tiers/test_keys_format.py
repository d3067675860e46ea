"""Chunk keys and the chunk object format: stable hashes, bit-exact round trips, misses."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tiers.format import FormatError, decode_layer, encode_chunk, parse_header
from tiers.keys import ChunkKey, Namespace, prefix_keys, segment_key

pytestmark = pytest.mark.cluster

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




@pytest.mark.parametrize("namespace,content", [
    ("..", "ab"),                 # the disk tier's file is <dir>/<content[:2]>/<ns>.<kind>.<content>
    ("ns", ".."),                 # content[:2] == ".." escapes the disk directory
    ("ns", "../../etc/x"),
    ("ns", "ab\0cd"),             # NUL: the OS refuses the file name after the index took the key
    ("ns", "ab cd"),
    ("n.s", "abcd"),              # dots split the disk file name into the wrong parts
    ("ns", "a" * 129),
    ("", "abcd"),
])
def test_keys_cannot_name_paths_outside_the_disk_directory(namespace, content):
    with pytest.raises(ValueError, match="ChunkKey part"):
        ChunkKey(namespace, "seg", content)
    with pytest.raises(ValueError):
        ChunkKey.parse(f"{namespace}/seg/{content}")


def test_keys_of_our_own_hashes_and_test_names_are_accepted():
    assert str(segment_key(NS, [1, 2, 3])).startswith(NS + "/seg/")
    assert ChunkKey.parse("ns0123456789abcd/pre/" + "f" * 32).kind == "pre"
    assert ChunkKey("rank_1-of-2", "seg", "0" * 128).namespace == "rank_1-of-2"
