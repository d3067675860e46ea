"""The per-tier circuit breaker of shard lookups (issue #20), unit-tested on a fake clock:
closed -> open after N consecutive failed lookups, skipped while open, one probe after the
cool-down (half-open), success closes and failure re-opens; one log line and one
``on_change`` per state change."""

from __future__ import annotations

import logging

import pytest

from cluster.cache.breaker import ALL, CLOSED, HALF_OPEN, OPEN, PROBE, TierBreaker
from tests.factories import FakeClock

pytestmark = pytest.mark.unit


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def changes():
    return []


@pytest.fixture
def breaker(clock, changes):
    return TierBreaker("redis", failures=3, cooldown_s=5.0, owner="shard-0", clock=clock,
                       on_change=lambda tier, old, new: changes.append((tier, old, new)))


def test_opens_after_three_consecutive_failures_and_logs_once(breaker, changes, caplog):
    with caplog.at_level(logging.WARNING, logger="kvblend.shard"):
        for _ in range(2):
            assert breaker.allow() == ALL
            breaker.record(False)
        assert breaker.state == CLOSED and changes == []
        breaker.record(False)
    assert breaker.state == OPEN
    assert changes == [("redis", CLOSED, OPEN)]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "redis" in lines[0] and "open" in lines[0]
    assert breaker.allow() is None  # skipped while open


def test_a_success_resets_the_count_of_consecutive_failures(breaker):
    for ok in (False, False, True, False, False):
        breaker.record(ok)
    assert breaker.state == CLOSED
    breaker.record(None)  # a lookup that read nothing there changes nothing
    assert breaker.state == CLOSED
    breaker.record(False)
    assert breaker.state == OPEN


def test_one_probe_after_the_cool_down_and_its_success_closes(breaker, clock, changes):
    for _ in range(3):
        breaker.record(False)
    clock.now += 4.9
    assert breaker.allow() is None
    clock.now += 0.2
    assert breaker.allow() == PROBE
    assert breaker.state == HALF_OPEN
    assert breaker.allow() is None  # one probe at a time: other lookups still skip it
    breaker.record(True)
    assert breaker.state == CLOSED and breaker.allow() == ALL
    assert changes == [("redis", CLOSED, OPEN), ("redis", OPEN, HALF_OPEN),
                       ("redis", HALF_OPEN, CLOSED)]


def test_a_failed_probe_reopens_for_a_new_cool_down(breaker, clock, changes):
    for _ in range(3):
        breaker.record(False)
    clock.now += 5.0
    assert breaker.allow() == PROBE
    breaker.record(False)
    assert breaker.state == OPEN
    clock.now += 4.0
    assert breaker.allow() is None
    clock.now += 1.0
    assert breaker.allow() == PROBE
    assert [c[2] for c in changes] == [OPEN, HALF_OPEN, OPEN, HALF_OPEN]


def test_a_probe_grant_that_read_nothing_frees_the_next_probe(breaker, clock):
    for _ in range(3):
        breaker.record(False)
    clock.now += 5.0
    assert breaker.allow() == PROBE
    breaker.record(None)  # that lookup found its keys above this tier
    assert breaker.state == HALF_OPEN
    assert breaker.allow() == PROBE


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        TierBreaker("redis", failures=0)
    with pytest.raises(ValueError):
        TierBreaker("redis", cooldown_s=0)
