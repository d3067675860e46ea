"""Rendezvous placement: even load, minimal movement, determinism (no Ray, no torch)."""

from __future__ import annotations

import pytest

from cluster.cache.placement import Placement, owner
from tiers.keys import segment_key

pytestmark = pytest.mark.unit

KEYS = [str(segment_key("ns0123456789abcd", [i, i * 7 + 1])) for i in range(10_000)]


@pytest.mark.parametrize("num_shards", [2, 3, 5])
def test_load_is_even(num_shards):
    p = Placement([f"kvblend-shard-n{i:08x}-0" for i in range(num_shards)])
    load = p.load(KEYS)
    mean = len(KEYS) / num_shards
    assert sum(load.values()) == len(KEYS)
    assert max(load.values()) / mean <= 1.15, load


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_adding_a_shard_moves_about_one_nth(num_shards):
    names = [f"kvblend-shard-n{i:08x}-0" for i in range(num_shards)]
    before = Placement(names)
    after = Placement(names + ["kvblend-shard-new00000-0"])
    n = num_shards + 1
    moved = before.moved(after, KEYS)
    assert 0 < moved <= 1.5 * len(KEYS) / n
    # every moved key moved to the new shard, none between old shards
    for k in KEYS[:2000]:
        if before.owner(k) != after.owner(k):
            assert after.owner(k) == "kvblend-shard-new00000-0"


def test_removing_a_shard_moves_only_its_keys():
    names = [f"s{i}" for i in range(4)]
    full, less = Placement(names), Placement(names[:3])
    for k in KEYS[:2000]:
        if full.owner(k) != "s3":
            assert less.owner(k) == full.owner(k)


def test_order_and_duplicates_do_not_matter():
    a = Placement(["b", "a", "c"])
    b = Placement(["c", "a", "b", "a"])
    assert a == b
    assert [a.owner(k) for k in KEYS[:500]] == [b.owner(k) for k in KEYS[:500]]


def test_group_partitions_indices():
    p = Placement(["x", "y", "z"])
    groups = p.group(KEYS[:300])
    assert sorted(i for idx in groups.values() for i in idx) == list(range(300))
    for shard, idx in groups.items():
        assert all(owner(KEYS[i], ["z", "y", "x"]) == shard for i in idx)


def test_empty_is_an_error():
    with pytest.raises(ValueError, match="at least one shard"):
        Placement([])
    with pytest.raises(ValueError):
        owner("k", [])
