"""cluster.vllm.events: the connector's event log round-trips, and an unwritable file never
raises into vLLM's hooks."""

from __future__ import annotations

import logging

import pytest

from cluster.vllm.events import EventLog, read_events

pytestmark = pytest.mark.unit


def test_events_round_trip_in_order(tmp_path):
    path = str(tmp_path / "events.jsonl")
    log = EventLog(path)
    log.write("lookup", request_id="r1", hit_segments=2)
    log.write("load", request_id="r1", ok=True)
    got = read_events(path)
    assert [(e["event"], e["request_id"]) for e in got] == [("lookup", "r1"), ("load", "r1")]
    assert got[0]["hit_segments"] == 2 and got[1]["ok"] is True
    assert log.write_errors == 0


def test_unwritable_path_drops_events_with_one_warning(tmp_path, caplog):
    path = str(tmp_path / "no-such-dir" / "events.jsonl")
    log = EventLog(path)
    with caplog.at_level(logging.WARNING, logger="kvblend.connector"):
        log.write("claim", request_id="r1")
        log.write("claim", request_id="r2")
    assert log.write_errors == 2
    assert sum("cannot write events" in r.getMessage() for r in caplog.records) == 1
    assert read_events(path) == []


def test_no_path_writes_nothing(tmp_path):
    log = EventLog(None)
    log.write("store", request_id="r1")
    assert log.write_errors == 0 and list(tmp_path.iterdir()) == []
