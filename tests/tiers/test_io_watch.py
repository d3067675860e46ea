"""Per-call deadline of the disk tier (issue #20: "disk I/O has no timeout"): the watch's
rules on a fake clock, and the product's disk tiers taking ``io_timeout_s`` from the config.
A real stalled device (a FIFO in place of a chunk file) is in
``tests/cluster/cache/test_disk_stall.py``.
"""

from __future__ import annotations

import pytest

from tiers import io_watch
from tiers.disk import DiskTier
from tiers.io_watch import IoWatch

pytestmark = pytest.mark.unit


def test_watch_refuses_while_a_call_is_past_its_deadline_then_admits(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(io_watch.time, "monotonic", lambda: now[0])
    watch = IoWatch(2.0, "disk")
    slow = watch.begin()
    quick = watch.begin()
    assert slow and quick and slow != quick
    watch.end(quick)
    now[0] += 2.0  # at the deadline: not past it
    assert not watch.stalled and watch.begin() is not None
    now[0] += 0.5
    assert watch.stalled
    assert watch.begin() is None and watch.begin() is None
    assert watch.stats() == {"io_timeouts": 0, "io_refused": 2}
    watch.end(slow)
    assert not watch.stalled
    assert watch.stats() == {"io_timeouts": 1, "io_refused": 2}
    assert watch.begin() is not None


def test_watch_off_admits_everything_and_rejects_a_bad_deadline():
    watch = IoWatch(None)
    assert watch.begin() == 0 and not watch.stalled
    watch.end(0)
    assert watch.stats() == {"io_timeouts": 0, "io_refused": 0}
    with pytest.raises(ValueError):
        IoWatch(0.0)


def test_disk_tiers_of_the_product_take_io_timeout_from_config(tmp_path):
    from tiers.config import TiersConfig
    from tiers.stack import TierStack

    cfg = TiersConfig(host_size_gib=0.01, disk_size_gib=0.01, io_timeout_s=0.7)
    stack = TierStack.from_config(cfg, str(tmp_path))
    try:
        (disk,) = [t for t in stack.tiers if isinstance(t, DiskTier)]
        assert disk._watch.timeout_s == 0.7
    finally:
        stack.close(timeout_s=30)
