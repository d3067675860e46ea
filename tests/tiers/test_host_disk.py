"""Host and disk tiers: zero-copy views, opaque objects, eviction order, pins, restarts."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.factories import make_key, make_kv, make_object
from tiers.disk import DiskTier
from tiers.host import HostTier

pytestmark = pytest.mark.unit


def test_host_returns_read_only_zero_copy_views():
    tier = HostTier(1 << 20)
    key = make_key(1)
    obj = make_object(key, make_kv())
    tier.put(key, obj)
    view = tier.get(key)
    assert view.readonly and view.obj is obj          # no copy of a bytes object
    with pytest.raises(TypeError):
        view[0] = 1
    buf = np.frombuffer(make_object(make_key(2), make_kv()), dtype=np.uint8).copy()
    tier.put(make_key(2), buf)
    expected = buf.tobytes()
    buf[:] = 0                                         # the caller reuses its buffer
    assert bytes(tier.get(make_key(2))) == expected


def test_host_objects_share_eviction_and_call_on_evict():
    evicted = []
    tier = HostTier(300, "lru", on_evict=lambda k, o: evicted.append((k, o)))
    keys = [make_key(i) for i in range(4)]
    assert tier.put_object(keys[0], "ref0", 100)
    assert tier.put_object(keys[1], "ref1", 100)
    assert tier.put(keys[2], b"x" * 100)
    assert tier.get_object(keys[0]) == "ref0"           # keys[1] is now least recent
    assert tier.put_object(keys[3], "ref3", 100)
    assert evicted == [(keys[1], "ref1")]
    assert tier.get(keys[0]) is None and tier.stats()["errors"] == 1  # str is no buffer
    assert tier.delete([keys[0]]) == 1 and evicted[-1] == (keys[0], "ref0")
    assert tier.stats()["bytes_used"] == 200


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_host_pinned_chunks_survive_pressure(policy):
    tier = HostTier(300, policy)
    keys = [make_key(i) for i in range(6)]
    for k in keys[:3]:
        tier.put(k, bytes(100))
    assert tier.pin(keys[:1] + [keys[5]]) == [True, False]
    for k in keys[3:5]:
        assert tier.put(k, bytes(100))
    assert tier.contains(keys[:5]) == [True, False, False, True, True]
    tier.pin(keys[3:5])
    assert not tier.put(keys[5], bytes(100))             # only pinned chunks left to evict
    assert tier.contains(keys[:5]) == [True, False, False, True, True]
    tier.unpin(keys[:1])
    assert tier.put(keys[5], bytes(100))
    assert tier.contains([keys[0], keys[5]]) == [False, True]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_disk_eviction_order(tmp_path, policy):
    tier = DiskTier(str(tmp_path), 3 * 1000, policy, fsync=False)
    keys = [make_key(i) for i in range(5)]
    for k in keys[:3]:
        assert tier.put(k, bytes(1000))
    for _ in range(2):
        tier.get(keys[0])
    tier.get(keys[1])                                   # lru: 2,0,1   lfu: 2(1),1(2),0(3)
    assert tier.put(keys[3], bytes(1000))
    assert tier.contains(keys[:4]) == [True, True, False, True]
    assert tier.put(keys[4], bytes(1000))
    victim = keys[0] if policy == "lru" else keys[3]    # lru: 0 is oldest; lfu: 3 used once
    assert not tier.contains([victim])[0]
    assert not os.path.exists(tier._file(victim))
    assert tier.stats()["evictions"] == 2


def test_disk_finds_its_chunks_after_restart(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, fsync=True)
    keys = [make_key(i) for i in range(3)]
    objs = [make_object(k, make_kv(seed=i)) for i, k in enumerate(keys)]
    for k, o in zip(keys, objs, strict=False):
        assert tier.put(k, o)
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / "not-a-chunk.kvbc").write_bytes(b"junk")   # ignored
    (tmp_path / "zz" / ".tmp-deadbeef").write_bytes(b"partial")     # a crashed write
    again = DiskTier(str(tmp_path), 1 << 20)
    assert again.contains(keys) == [True, True, True]
    assert [again.get(k) for k in keys] == objs
    assert again.stats()["bytes_used"] == sum(len(o) for o in objs)
    assert again.keys() == keys                          # LRU order restored from mtimes
    small = DiskTier(str(tmp_path), len(objs[2]) + 1)    # capacity shrank: oldest go
    assert small.contains(keys) == [False, False, True]


def test_disk_pins_and_no_temp_files_left(tmp_path):
    tier = DiskTier(str(tmp_path), 2000, fsync=False)
    a, b, c = (make_key(i) for i in range(3))
    tier.put(a, bytes(1000))
    tier.put(b, bytes(1000))
    assert tier.pin([a]) == [True]
    assert tier.put(c, bytes(1000))
    assert tier.contains([a, b, c]) == [True, False, True]
    tier.pin([c])
    assert not tier.put(b, bytes(1000))
    names = [n for _, _, files in os.walk(tmp_path) for n in files]
    assert len(names) == 2 and not any(n.startswith(".tmp-") for n in names)


def test_disk_io_error_is_a_miss(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, fsync=False)
    key = make_key(1)
    tier.put(key, make_object(key, make_kv()))
    os.unlink(tier._file(key))                           # removed behind the tier's back
    assert tier.get(key) is None
    assert tier.get_ranges(key, [(0, 4)]) is None
    assert tier.stats()["errors"] >= 1
    assert tier.contains([key]) == [False]
