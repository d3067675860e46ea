"""The shard's fault counters on Prometheus (issue #20), without Ray: ``kvblend_writes_dropped``,
``kvblend_lookup_timeouts``, ``kvblend_breaker_transitions`` and the ``kvblend_breaker_open``
gauge are emitted where ``writes_dropped``, ``lookup_timeouts`` and ``breaker_<state>`` are
counted, with the tag keys :data:`cluster.cache.metrics.METRICS` declares.

The shard's :class:`~cluster.cache.metrics.ShardMetrics` gets stand-in metric objects
(:func:`_record`) that check each call's tags as Ray does (every declared key, ``shard`` from
the default tags) and record it. ``CacheShard`` is built in-process (``ray_free_shard``) with
stand-in lower tiers as in ``test_lookup_deadline.py`` / ``test_put_backpressure.py``; the
breaker's clock is a fake one. The only timing is a hang guard (``returns_within``).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cluster.cache.metrics import METRICS, ShardMetrics, prometheus_names
from tests.factories import (
    HANG_S,
    FakeClock,
    make_key,
    make_kv,
    make_object,
    ray_free_shard,
    returns_within,
    stop_shard,
)
from tiers import write_behind
from tiers.config import TiersConfig

pytestmark = pytest.mark.unit

FAULT_METRICS = ("kvblend_writes_dropped", "kvblend_lookup_timeouts",
                 "kvblend_breaker_transitions", "kvblend_breaker_open")
#: generous: the deadline must not pass while the tiers answer at once on a loaded machine
TIMEOUT_S = 2.0


class _Recorder:
    """What a :class:`ShardMetrics` was asked to emit: ``calls`` ``(name, value, tags)``;
    ``errors`` the calls Ray would have refused (wrong tags, or method for the kind)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, dict]] = []
        self.errors: list[str] = []

    def of(self, names=FAULT_METRICS) -> list[tuple[str, float, dict]]:
        return [c for c in self.calls if c[0] in names]


class _Metric:
    def __init__(self, name: str, rec: _Recorder) -> None:
        self.name = name
        self.kind, _, keys = METRICS[name]
        self.keys = set(keys)
        self.rec = rec

    def _record(self, kind: str, value: float, tags: dict | None) -> None:
        got = {"shard"} | set(tags or {})  # "shard" is a default tag
        if kind != self.kind or got != self.keys:
            self.rec.errors.append(f"{self.name}: {kind} with tags {sorted(got)}")
            raise ValueError(self.rec.errors[-1])
        self.rec.calls.append((self.name, float(value), dict(tags or {})))

    def inc(self, value, tags=None):
        self._record("counter", value, tags)

    def set(self, value, tags=None):
        self._record("gauge", value, tags)

    def observe(self, value, tags=None):
        self._record("histogram", value, tags)


def _record(metrics: ShardMetrics) -> _Recorder:
    """Turn ``metrics`` (built disabled) on, with stand-in metrics of every declared name."""
    rec = _Recorder()
    metrics._m = {name: _Metric(name, rec) for name in METRICS}
    metrics.enabled = True
    return rec


def test_fault_metrics_are_declared_with_their_tags():
    assert {n: METRICS[n][0::2] for n in FAULT_METRICS} == {
        "kvblend_writes_dropped": ("counter", ("shard",)),
        "kvblend_lookup_timeouts": ("counter", ("shard",)),
        "kvblend_breaker_transitions": ("counter", ("shard", "tier", "state")),
        "kvblend_breaker_open": ("gauge", ("shard", "tier")),
    }
    assert {"ray_kvblend_writes_dropped_total", "ray_kvblend_lookup_timeouts_total",
            "ray_kvblend_breaker_transitions_total", "ray_kvblend_breaker_open"} <= prometheus_names()


def test_shard_metrics_pass_tier_and_state_tags_and_never_raise():
    m = ShardMetrics("shard-x", enabled=False)
    m.inc("kvblend_breaker_transitions", 1, "redis", state="open")  # disabled: no-ops
    m.set("kvblend_breaker_open", 1, "redis")
    rec = _record(m)
    m.inc("kvblend_breaker_transitions", 1, "redis", state="open")
    m.set("kvblend_breaker_open", 1, "redis")
    m.inc("kvblend_writes_dropped")
    m.inc("kvblend_lookup_timeouts", 3)
    m.inc("kvblend_hits", 1, "disk")
    assert rec.calls == [
        ("kvblend_breaker_transitions", 1.0, {"tier": "redis", "state": "open"}),
        ("kvblend_breaker_open", 1.0, {"tier": "redis"}),
        ("kvblend_writes_dropped", 1.0, {}),
        ("kvblend_lookup_timeouts", 3.0, {}),
        ("kvblend_hits", 1.0, {"tier": "disk"}),
    ]
    assert rec.errors == []
    # what Ray would refuse is swallowed, never raised into the data path
    m.inc("kvblend_breaker_transitions", 1, "redis")  # no state tag
    m.set("kvblend_writes_dropped", 1)  # a counter has no set
    m.inc("kvblend_no_such_metric")
    assert len(rec.errors) == 2 and len(rec.calls) == 5


# -- breaker and lookup deadline ----------------------------------------------------------------
class _Tier:
    """A lower tier with ``head`` holding nothing; while ``block`` every read waits on
    ``release`` (at most 3 x HANG_S)."""

    def __init__(self, name: str, block: bool = False) -> None:
        self.name = name
        self.block = block
        self.release = threading.Event()

    def head(self, key, max_bytes):
        if self.block:
            self.release.wait(HANG_S * 3)
        return None

    def stats(self):
        return {}


@pytest.fixture
def shard(monkeypatch, tmp_path):
    s = ray_free_shard(monkeypatch, tmp_path,
                       TiersConfig(host_size_gib=0.001, disk_size_gib=0.0, lookup_timeout_s=TIMEOUT_S))
    s.slow, s.fast = _Tier("redis", block=True), _Tier("s3")
    s.lower = [s.slow, s.fast]
    s.rec = _record(s.metrics)
    yield s
    s.slow.release.set()
    s._lower_lookup.close()
    stop_shard(s)


def test_breaker_changes_and_lookup_timeouts_are_emitted_where_counted(shard):
    lookup, rec = shard._lower_lookup, shard.rec
    lookup.failures = 1  # one timed-out lookup opens a tier's breaker
    clock = FakeClock()
    for tier in ("redis", "s3"):
        lookup.breaker(tier)._clock = clock
    assert rec.of() == [("kvblend_breaker_open", 0.0, {"tier": "redis"}),  # closed from the start
                        ("kvblend_breaker_open", 0.0, {"tier": "s3"})]
    keys = [str(make_key(i)) for i in range(4)]

    # redis blocks: every key is late, and redis's breaker opens
    assert returns_within(shard.lookup, keys, False) == [None] * 4
    assert shard.counters["lookup_timeouts"] == 4 and shard.counters["breaker_open"] == 1
    assert rec.of()[2:] == [
        ("kvblend_breaker_transitions", 1.0, {"tier": "redis", "state": "open"}),
        ("kvblend_breaker_open", 1.0, {"tier": "redis"}),
        ("kvblend_lookup_timeouts", 4.0, {}),
    ]

    # redis answers again; after the cool-down one probe (half-open) succeeds: closed
    shard.slow.block = False
    shard.slow.release.set()
    clock.now += lookup.cooldown_s
    assert returns_within(shard.lookup, keys, False) == [None] * 4
    assert shard.counters["breaker_half_open"] == 1 and shard.counters["breaker_closed"] == 1
    assert shard.counters["lookup_timeouts"] == 4
    assert rec.of()[5:] == [
        ("kvblend_breaker_transitions", 1.0, {"tier": "redis", "state": "half_open"}),
        ("kvblend_breaker_open", 1.0, {"tier": "redis"}),
        ("kvblend_breaker_transitions", 1.0, {"tier": "redis", "state": "closed"}),
        ("kvblend_breaker_open", 0.0, {"tier": "redis"}),
    ]
    assert rec.errors == []
    # the metrics add up to the counters of stats()
    counters = shard.stats()["counters"]
    for state in ("open", "half_open", "closed"):
        assert sum(c[1] for c in rec.of(["kvblend_breaker_transitions"])
                   if c[2]["state"] == state) == counters[f"breaker_{state}"]
    assert sum(c[1] for c in rec.of(["kvblend_lookup_timeouts"])) == counters["lookup_timeouts"]


# -- dropped write-downs ------------------------------------------------------------------------
class _BlockingLower:
    """A lower stack whose writes block until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def store(self, key, obj, names, *, header=None):
        self.release.wait(HANG_S * 3)
        return {}

    def flush(self, timeout_s=None):
        return True


def test_dropped_write_downs_are_emitted(monkeypatch, tmp_path):
    s = ray_free_shard(monkeypatch, tmp_path, TiersConfig(host_size_gib=0.01, disk_size_gib=0.0))
    s.lower_stack = _BlockingLower()
    rec = _record(s.metrics)
    monkeypatch.setattr(write_behind, "MAX_PENDING_WRITES", 1)
    try:
        for i in range(3):  # the first write-down blocks; the next two are dropped
            key = make_key(i)
            obj = np.frombuffer(make_object(key, make_kv(i)), dtype=np.uint8)
            assert returns_within(s.put, str(key), obj) is True
        assert s.counters["writes_dropped"] == 2
        assert rec.of() == [("kvblend_writes_dropped", 1.0, {})] * 2
        assert rec.errors == []
    finally:
        s.lower_stack.release.set()
        s._lower_lookup.close()
        stop_shard(s)


def test_oversized_whole_reads_of_a_tier_are_a_counter_per_tier():
    """#37: a shared tier's ``oversized`` (values over the read bound, never read) reaches the
    shard's metrics as ``kvblend_oversized`` deltas, tagged by tier."""
    metrics = ShardMetrics("s0", enabled=False)
    rec = _record(metrics)
    for seen in (0, 2, 2, 5):
        metrics.tier_stats("redis", {"oversized": seen})
    assert rec.of(("kvblend_oversized",)) == [("kvblend_oversized", 2.0, {"tier": "redis"}),
                                              ("kvblend_oversized", 3.0, {"tier": "redis"})]
    assert not rec.errors
