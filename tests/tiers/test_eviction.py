"""EvictionIndex: exact LRU/LFU victim order by bytes, pins, admission failure."""

from __future__ import annotations

import builtins
import heapq as real_heapq
import random
from types import SimpleNamespace

import pytest

from tiers import eviction
from tiers.eviction import EvictionIndex

pytestmark = pytest.mark.unit


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


class _Reference:
    """The eviction order by its definition, by brute force: the unpinned keys sorted by
    (last use) for LRU, (uses, last use) for LFU."""

    def __init__(self, capacity: int, policy: str) -> None:
        self.capacity, self.policy = capacity, policy
        self.sizes: dict = {}
        self.uses: dict = {}
        self.last: dict = {}
        self.pins: dict = {}
        self.clock = 0

    def _use(self, key, new: bool) -> None:
        self.clock += 1
        self.last[key] = self.clock
        self.uses[key] = 1 if new else self.uses[key] + 1

    def admit(self, key, nbytes: int):
        if key in self.sizes:
            self._use(key, False)
            return []
        if nbytes > self.capacity:
            return None
        need = sum(self.sizes.values()) + nbytes - self.capacity
        rank = (lambda k: self.last[k]) if self.policy == "lru" else (lambda k: (self.uses[k], self.last[k]))
        victims = []
        for k in sorted(self.sizes, key=rank):
            if need <= 0:
                break
            if self.pins.get(k, 0) == 0:
                victims.append(k)
                need -= self.sizes[k]
        if need > 0:
            return None
        for k in victims:
            del self.sizes[k]
        self.sizes[key] = nbytes
        self._use(key, True)
        return victims


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victim_order_matches_the_definition_over_a_scripted_run(policy):
    rng = random.Random(20)
    idx, ref = EvictionIndex(400, policy), _Reference(400, policy)
    for _ in range(5000):
        op, key = rng.random(), rng.randrange(60)
        if op < 0.45:
            nbytes = rng.choice([0, 5, 10, 10, 20, 40, 120])
            assert idx.admit(key, nbytes) == ref.admit(key, nbytes)
        elif op < 0.8:
            idx.touch(key)
            if key in ref.sizes:
                ref._use(key, False)
        elif op < 0.88:
            assert idx.pin(key) == (key in ref.sizes)
            if key in ref.sizes:
                ref.pins[key] = ref.pins.get(key, 0) + 1
        elif op < 0.96:
            idx.unpin(key)
            if ref.pins.get(key, 0) > 0:
                ref.pins[key] -= 1
        else:
            assert idx.remove(key) == ref.sizes.pop(key, None)
        assert sorted(idx.keys()) == sorted(ref.sizes)
        assert idx.used_bytes == sum(ref.sizes.values())


def test_lfu_puts_do_no_linear_work_per_call(monkeypatch):
    """A deterministic proxy of the cost of ``admit``/``touch`` under the tier lock: the heap
    entries they push, pop, heapify or copy. Copying the heap on every put (as before) is
    ~n per call; a lazy heap is a few per call, amortized (heapify of n live entries now and
    then, after ~3n pushes)."""
    work = {"push": 0, "pop": 0, "heapified": 0, "copied": 0}

    def push(heap, item):
        work["push"] += 1
        real_heapq.heappush(heap, item)

    def pop(heap):
        work["pop"] += 1
        return real_heapq.heappop(heap)

    def heapify(heap):
        work["heapified"] += len(heap)
        real_heapq.heapify(heap)

    def copying_list(iterable=()):
        out = builtins.list(iterable)
        work["copied"] += len(out)
        return out

    monkeypatch.setattr(eviction, "heapq", SimpleNamespace(heappush=push, heappop=pop, heapify=heapify))
    monkeypatch.setattr(eviction, "list", copying_list, raising=False)  # shadows the builtin there

    n = 2000
    idx = EvictionIndex(n, "lfu")
    for k in range(n):                      # fill: no evictions
        assert idx.admit(k, 1) == []
    idx.pin(0)
    calls = 0
    for i in range(4 * n):                  # full: every new put evicts one
        key = n + i
        victims = idx.admit(key, 1)
        assert victims is not None and len(victims) == 1 and victims[0] != 0
        idx.touch(key)
        idx.touch((key * 7919) % (n + i))  # an older key (or an evicted one: ignored)
        calls += 3
    calls += n
    assert 0 in idx and len(idx) == n
    total = sum(work.values())
    assert work["copied"] == 0, work
    assert total <= 8 * calls, (total, calls, work)
