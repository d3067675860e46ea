"""``kvblend bench faults``' placement (cluster.bench.fault_setup.place): a write-through the
ingest lost is completed from a valid copy before the rows run, so ``corrupt_objects`` and
``deleted_object`` act on a copy in every tier (CI once saw Redis hold 1 of 2); the rows whose
fault is about a tier still lose their copies there."""

from __future__ import annotations

import pytest

from cluster.bench.fault_setup import place
from tests.factories import make_key, make_kv, make_object
from tiers.disk import DiskTier
from tiers.tier import MemoryTier

pytestmark = pytest.mark.unit


def test_place_completes_lost_copies_then_removes_each_rows_tiers(tmp_path):
    tiers = {"disk": DiskTier(str(tmp_path), 1 << 20, fsync=False),
             "redis": MemoryTier(1 << 20, "redis"), "s3": MemoryTier(1 << 20, "s3")}
    corrupt = [make_key(1), make_key(2)]
    blackhole = [make_key(3)]
    for i, key in enumerate(corrupt + blackhole):
        obj = make_object(key, make_kv(i))
        for name, tier in tiers.items():
            if not (key == corrupt[1] and name == "redis"):  # the write-through Redis lost
                assert tier.put(key, obj)
    tiers["s3"].put(corrupt[0], b"KVBC garbage")  # a corrupt copy is no source, and is kept
    removed = place(tiers, {"corrupt_objects": corrupt, "redis_blackhole": blackhole})
    assert removed == {"disk": 1}
    assert tiers["redis"].contains(corrupt) == [True, True]
    assert tiers["redis"].get(corrupt[1]) == tiers["disk"].get(corrupt[1])
    # its file is gone behind the index, as a shard's disk sees it on restart
    assert tiers["disk"].get(blackhole[0]) is None and tiers["redis"].contains(blackhole) == [True]
