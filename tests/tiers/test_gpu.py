"""GpuTier on device="cpu", and on CUDA where a GPU is present (``@pytest.mark.gpu``)."""

from __future__ import annotations

import pytest
import torch

from tests.factories import make_key, make_kv, make_object, make_prefix_key
from tiers.gpu import GpuTier
from tiers.host import HostTier

pytestmark = pytest.mark.unit


def _exercise_gpu_tier(device: str) -> None:
    kv = make_kv()
    nbytes = kv.numel() * kv.element_size()
    tier = GpuTier(3 * nbytes, device=device)
    keys = [make_key(i) for i in range(5)]
    assert tier.put(keys[0], kv) and tier.put(keys[1], kv * 2) and tier.put(keys[2], kv * 3)
    layer = tier.get_layer(keys[1], 2)
    assert layer.device.type == torch.device(device).type
    assert torch.equal(layer.cpu(), kv[2] * 2)
    assert tier.get_layer(keys[1], 3) is None
    tier.pin([keys[0]])                       # LRU order 0, 2, 1: keys[0] is oldest but pinned
    assert tier.put(keys[3], kv)
    assert tier.contains(keys[:4]) == [True, True, False, True]
    tier.pin([keys[1], keys[3]])
    assert not tier.put(keys[4], kv)                     # only pinned chunks to evict
    tier.unpin(keys[:4])
    assert tier.put(keys[4], kv, positions=range(10, 18))
    assert tier.contains(keys) == [False, True, False, True, True]
    assert tier.positions(keys[4]) == tuple(range(10, 18))
    assert tier.stats()["bytes_used"] == 3 * nbytes
    with pytest.raises(ValueError):
        tier.put(make_key(9), kv[0])
    # load from a byte tier (lz4 object, shifted positions) bit-exactly
    host = HostTier(1 << 20)
    key = make_prefix_key(42)  # a prefix chunk: a segment's positions are canonical
    src = make_kv(seed=7, compressible=True)
    host.put(key, make_object(key, src, compress=True, positions=range(5, 13)))
    fresh = GpuTier(1 << 20, device=device)
    assert fresh.load(host, key)
    assert torch.equal(fresh.get(key).cpu(), src) and fresh.positions(key) == tuple(range(5, 13))
    assert not fresh.load(host, make_key(43))


def test_gpu_tier_on_cpu():
    _exercise_gpu_tier("cpu")


@pytest.mark.gpu
def test_gpu_tier_on_cuda():
    _exercise_gpu_tier("cuda")
