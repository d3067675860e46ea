"""``ThrottledTier`` (issue 34's stand-in for a slow tier): reads are paced to the bandwidth
given, one schedule for every thread, bytes unchanged; the rate may change while it serves.
A scripted clock: no real sleep, no timed assertion."""

from __future__ import annotations

import pytest
import torch

from cluster.workloads import faults
from cluster.workloads.faults import ThrottledTier
from tests.factories import make_key
from tiers.tier import MemoryTier

pytestmark = pytest.mark.unit


@pytest.fixture
def clock(monkeypatch):
    """A fake ``time.monotonic`` that ``time.sleep`` advances; ``clock.slept`` lists the sleeps."""

    class Clock:
        now, slept = 100.0, []

        def monotonic(self):
            return self.now

        def sleep(self, s):
            self.slept.append(s)
            self.now += s

    c = Clock()
    monkeypatch.setattr(faults.time, "monotonic", c.monotonic)
    monkeypatch.setattr(faults.time, "sleep", c.sleep)
    return c


def test_reads_are_paced_to_the_bandwidth_and_bytes_unchanged(clock):
    inner = MemoryTier(1 << 30, name="disk")
    key = make_key(1)
    obj = bytes(range(256)) * 4096  # 1 MiB
    inner.put(key, obj)
    tier = ThrottledTier(inner, gbps=0.001, latency_s=0.01, name="slow")  # 1 MB/s
    assert tier.name == "slow" and tier.contains([key]) == [True]
    assert bytes(tier.get(key)) == obj
    assert clock.slept[-1] == pytest.approx(0.01 + len(obj) / 1e6)
    got = tier.get_ranges(key, [(0, 1000), (5000, 3000)])
    assert [bytes(b) for b in got] == [obj[:1000], obj[5000:8000]]
    assert clock.slept[-1] == pytest.approx(0.01 + 4000 / 1e6)
    assert tier.get(make_key(2)) is None  # a miss waits for nothing
    assert len(clock.slept) == 2


def test_reads_queue_behind_each_other_and_the_rate_can_change(clock):
    inner = MemoryTier(1 << 30)
    key = make_key(1)
    inner.put(key, b"x" * 1_000_000)
    tier = ThrottledTier(inner, gbps=0.001)
    tier._pace(1_000_000)  # noqa: SLF001 - one read queued: the schedule is 1 s ahead
    clock.now -= 1.0       # ... as seen by a second thread starting at the same instant
    tier.get(key)
    assert clock.slept[-1] == pytest.approx(2.0)  # behind the first read
    tier.gbps = 0.01  # the tier recovers tenfold
    clock.now += 10
    tier.get(key)
    assert clock.slept[-1] == pytest.approx(0.1)


def test_a_rate_must_be_positive():
    with pytest.raises(ValueError, match="gbps"):
        ThrottledTier(MemoryTier(1 << 20), gbps=0)



def test_every_layer_read_goes_through_the_throttle(clock, tmp_path):
    """The layer reader of the staging path (``tiers.reader.read_layers``) prefers a disk
    tier's reads into caller buffers; through a ThrottledTier it must take a paced read, and
    the bytes it reads are the stored layer's."""
    from tests.factories import as_layer, layer_buffers, make_kv, make_object
    from tiers.disk import DiskTier
    from tiers.reader import read_layers

    disk = DiskTier(str(tmp_path / "disk"), 1 << 30, fsync=False)
    key = make_key(3)
    kv = make_kv(3, num_tokens=4096)
    disk.put(key, make_object(key, kv))
    tier = ThrottledTier(disk, gbps=0.001, name="slow")
    assert not hasattr(tier, "get_ranges_into") and not hasattr(tier, "open_stream")
    outs = layer_buffers(kv)
    assert read_layers(tier, key, [1], outs[1:2]) is not None
    assert sum(clock.slept) >= len(outs[1]) / 1e6  # at least the layer's bytes were paced
    assert torch.equal(as_layer(outs[1], kv[1]), kv[1])
