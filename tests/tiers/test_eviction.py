"""EvictionIndex: exact LRU/LFU victim order by bytes, pins, admission failure."""

from __future__ import annotations

import pytest

from tiers.eviction import EvictionIndex


def test_lru_evicts_least_recently_used_first():
    idx = EvictionIndex(30, "lru")
    for k in "abc":
        assert idx.admit(k, 10) == []
    idx.touch("a")                       # order now b, c, a
    assert idx.admit("d", 10) == ["b"]
    assert idx.admit("e", 20) == ["c", "a"]
    assert idx.keys() == ["d", "e"] and idx.used_bytes == 30


def test_lfu_evicts_fewest_uses_then_oldest():
    idx = EvictionIndex(30, "lfu")
    for k in "abc":
        idx.admit(k, 10)
    for _ in range(3):
        idx.touch("a")
    idx.touch("b")                       # counts a=4, b=2, c=1
    assert idx.admit("d", 10) == ["c"]   # d=1
    assert idx.admit("e", 10) == ["d"]   # e=1
    idx.touch("e")
    idx.touch("e")                       # e=3 > b=2
    assert idx.admit("f", 20) == ["b", "e"]
    assert sorted(idx.keys()) == ["a", "f"]


def test_lfu_ties_break_by_recency():
    idx = EvictionIndex(20, "lfu")
    idx.admit("a", 10)
    idx.admit("b", 10)
    idx.touch("a")
    idx.touch("b")                       # both 2, a used less recently
    assert idx.admit("c", 10) == ["a"]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_pinned_keys_are_never_victims(policy):
    idx = EvictionIndex(30, policy)
    for k in "abc":
        idx.admit(k, 10)
    assert idx.pin("a") and idx.pin("a")  # nested
    assert idx.admit("d", 10) == ["b"]
    idx.unpin("a")
    assert idx.admit("e", 10) == ["c"]   # a still pinned once
    idx.unpin("a")
    assert idx.admit("f", 10) == ["a"]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_admit_that_needs_pinned_room_changes_nothing(policy):
    idx = EvictionIndex(30, policy)
    for k in "abc":
        idx.admit(k, 10)
    idx.pin("a")
    idx.pin("b")
    assert idx.admit("big", 25) is None
    assert idx.admit("huge", 31) is None
    assert sorted(idx.keys()) == ["a", "b", "c"] and idx.used_bytes == 30
    assert idx.admit("d", 10) == ["c"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        EvictionIndex(10, "fifo")
    with pytest.raises(ValueError, match="capacity"):
        EvictionIndex(-1)
    assert not EvictionIndex(10).pin("absent")
