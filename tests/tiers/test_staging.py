"""StagedSource (tiers.staging) on the CPU: bit-exact round trips from every tier, corrupt or
missing chunks and layers as misses, a header gone stale, lz4 layers decoded. The staged
pipeline under the blend engine, on CUDA: ``tests/blend/test_ops_cuda.py``."""

from __future__ import annotations

import torch

from tests.factories import NAMESPACE, make_object
from tiers.disk import DiskTier
from tiers.gpu import GpuTier
from tiers.host import HostTier
from tiers.keys import segment_key
from tiers.staging import StagedSource
from tiers.tier import MemoryTier


def _objects(num_chunks=3, num_layers=3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(9)
    out = {}
    for i in range(num_chunks):
        key = segment_key(NAMESPACE, [i, 100 + i])
        out[key] = torch.randn(num_layers, 2, 5 + i, 2, 8, generator=g).to(dtype)
    return out


def test_staged_source_round_trips_every_tier_bit_exact(tmp_path):
    chunks = _objects()
    host, disk, gpu, mem = HostTier(1 << 26), DiskTier(str(tmp_path), 1 << 26, fsync=False), GpuTier(1 << 26), MemoryTier(1 << 26)
    for key, kv in chunks.items():
        obj = make_object(key, kv)
        host.put(key, obj), disk.put(key, obj), mem.put(key, obj), gpu.put(key, kv)
    keys = list(chunks)
    for tier in (host, disk, mem, gpu):
        src = StagedSource(tier, "cpu", read_ahead=1)
        metas = src.lookup(keys)
        assert [m.num_tokens for m in metas] == [5, 6, 7] and metas[0].positions == tuple(range(5))
        assert metas[0].tier == tier.name
        for layer in range(3):
            got = src.fetch_layer(keys, layer).result()
            assert all(torch.equal(x, chunks[key][layer]) for x, key in zip(got, keys, strict=False)), tier.name
        src.close()


def test_staged_source_corrupt_or_missing_is_none(tmp_path):
    chunks = _objects()
    host = HostTier(1 << 26)
    keys = list(chunks)
    for i, (key, kv) in enumerate(chunks.items()):
        obj = bytearray(make_object(key, kv))
        if i == 1:
            obj[-3] ^= 0xFF  # flip a byte in the last layer's payload
        host.put(key, bytes(obj))
    missing = segment_key(NAMESPACE, [999])
    src = StagedSource(host, "cpu")
    assert src.lookup(keys + [missing])[-1] is None
    got = src.fetch_layer(keys + [missing], 2).result()
    assert got[1] is None and got[3] is None
    assert torch.equal(got[0], chunks[keys[0]][2]) and torch.equal(got[2], chunks[keys[2]][2])
    assert src.fetch_layer(keys, 0).result()[1] is not None  # only the flipped layer is bad
    assert src.fetch_layer(keys, 7).result() == [None, None, None]  # past the layers
    assert src.read_counters.snapshot()["corrupt"] >= 1
    src.close()


def test_staged_source_drops_a_header_that_went_stale(tmp_path):
    """The object under a key is re-encoded (raw -> lz4: other offsets and checksums) after
    its header was cached: that read is a miss, the header is dropped, and the next reads are
    bit-exact again (the stale header does not stick)."""
    g = torch.Generator().manual_seed(3)
    key = segment_key(NAMESPACE, [7, 8])
    kv = torch.randint(-2, 3, (3, 2, 64, 2, 8), generator=g).to(torch.bfloat16)  # lz4 shrinks it
    disk = DiskTier(str(tmp_path), 1 << 26, fsync=False)
    disk.put(key, make_object(key, kv))
    src = StagedSource(disk, "cpu", read_ahead=0)
    assert src.lookup([key])[0] is not None
    assert torch.equal(src.fetch_layer([key], 0).result()[0], kv[0])
    disk.delete([key])
    disk.put(key, make_object(key, kv, compress=True))
    assert src.fetch_layer([key], 1).result()[0] is None   # read with the cached raw header
    for layer in (2, 0, 1):
        assert torch.equal(src.fetch_layer([key], layer).result()[0], kv[layer]), layer
    src.close()


def test_staged_source_decodes_lz4_layers(tmp_path):
    from tiers.format import encode_chunk

    key = segment_key(NAMESPACE, [7, 7, 7])
    kv = torch.ones(2, 2, 64, 2, 8, dtype=torch.bfloat16)  # compressible: stored as lz4
    kv[1] *= 3
    raw = kv.view(torch.uint8).view(2, -1).numpy()
    obj = encode_chunk(key, [raw[0], raw[1]], dtype="bfloat16", num_tokens=64, num_kv_heads=2,
                       head_dim=8, compress=True)
    assert len(obj) < kv.numel() * 2
    for tier in (HostTier(1 << 24), DiskTier(str(tmp_path), 1 << 24, fsync=False)):
        tier.put(key, obj)
        src = StagedSource(tier, "cpu")
        assert src.lookup([key])[0].num_tokens == 64
        for layer in range(2):
            assert torch.equal(src.fetch_layer([key], layer).result()[0], kv[layer])
        assert src.read_counters.snapshot() == {"hits": 2, "misses": 0, "corrupt": 0}
        src.close()
