"""The machine-local cache client (no Ray): bit-exact round trips through the chunk format
(raw and lz4 layers, stored positions); a corrupted or truncated object is a miss."""

from __future__ import annotations

import pytest
import torch

from cluster.cache.local import LocalCacheClient
from tiers.codec import encode_kv
from tiers.format import parse_header
from tiers.keys import Namespace, prefix_keys, segment_key

pytestmark = pytest.mark.unit

NS = Namespace("m", "fp", "bfloat16", 2, 2, 4).digest()


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("compress", [False, True])
def test_round_trip_bit_exact(dtype, compress):
    key = prefix_keys(NS, [1, 2, 3], 3)[0]  # a prefix chunk: a segment's positions are canonical
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


def test_a_forged_header_is_a_miss_before_anything_is_allocated():
    """The client parses headers itself (not through tiers.reader): a header whose position runs
    expand to 10M entries, or whose layer claims 4 GiB, is a miss and a read error."""
    from tests.factories import forge_header

    key = segment_key(NS, [4, 5])
    client = LocalCacheClient()
    client.put(key, torch.randn(2, 2, 4, 2, 4, dtype=torch.bfloat16))
    good = client.tier._data[key]
    for forged in (forge_header(good, positions=[[0, 10_000_000], [0, -9_999_996]]),
                   forge_header(good, num_kv_heads=1 << 28)):
        client.tier._data[key] = forged
        before = client.counters["read_errors"]
        assert client.lookup([key]) == [None]
        assert client.counters["read_errors"] == before + 1
    client.tier._data[key] = good
    assert client.lookup([key])[0].num_tokens == 4
