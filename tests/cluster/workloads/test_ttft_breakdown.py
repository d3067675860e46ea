"""The demo's TTFT breakdown (issue 36) from a client's send times and the connector's events:
each part is the span between two recorded instants, the parts tile the TTFT, and another
replica's stores count only where they overlap the request."""

from __future__ import annotations

import pytest

from cluster.workloads.ttft_breakdown import format_breakdown, request_breakdown, ttft_breakdown

pytestmark = pytest.mark.unit


def _events(rid: str, sent: float, *, pid: int = 7) -> list[dict]:
    """A blended request: plan 0.2 s after the send, lasting 0.05 s; the worker starts 0.1 s
    later and blends 1.0 s (probe 0.1 + other compute 0.5 + wait 0.3 + gaps 0.1)."""
    vid = f"{rid}-0-abcd1234"
    return [
        {"event": "lookup", "time": sent + 0.25, "pid": pid, "request_id": vid, "plan_s": 0.05},
        {"event": "claim", "time": sent + 0.25, "pid": pid, "request_id": vid},
        {"event": "load", "time": sent + 1.35, "pid": pid, "request_id": vid, "path": "blend",
         "wall_s": 1.0, "probe_s": 0.1, "compute_s": 0.6, "load_wait_s": 0.3,
         "engine_steps": 1, "busy_steps": 0},
    ]


def test_parts_tile_the_ttft():
    sent = 1000.0
    got = request_breakdown({"id": "cmpl-1", "sent_at": sent, "ttft_s": 1.6}, _events("cmpl-1", sent))
    assert got is not None
    assert got["front_s"] == pytest.approx(0.2)
    assert got["plan_s"] == pytest.approx(0.05)
    assert got["to_load_s"] == pytest.approx(0.1)
    assert got["load_s"] == pytest.approx(1.0)
    assert (got["probe_s"], got["compute_s"], got["load_wait_s"], got["load_gaps_s"]) == pytest.approx(
        (0.1, 0.5, 0.3, 0.1))
    assert got["after_load_s"] == pytest.approx(0.25)
    tiled = got["front_s"] + got["plan_s"] + got["to_load_s"] + got["load_s"] + got["after_load_s"]
    assert tiled == pytest.approx(got["ttft_s"])
    assert got["other_stores_s"] == 0.0


def test_only_the_other_replicas_overlapping_stores_count():
    sent = 1000.0
    events = _events("cmpl-2", sent) + [
        {"event": "store", "time": sent + 0.5, "pid": 8, "request_id": "x", "seconds": 1.0},  # 0.5 s inside
        {"event": "store", "time": sent - 1.0, "pid": 8, "request_id": "y", "seconds": 1.0},  # before it
        {"event": "store", "time": sent + 1.0, "pid": 7, "request_id": "z", "seconds": 1.0},  # its own replica
    ]
    got = request_breakdown({"id": "cmpl-2", "sent_at": sent, "ttft_s": 1.6}, events)
    assert got["other_stores_s"] == pytest.approx(0.5)


def test_requests_without_a_blend_are_left_out_and_counted():
    sent = 1000.0
    events = _events("cmpl-3", sent)
    events[-1] = {**events[-1], "path": "prefix"}
    requests = [{"id": "cmpl-3", "sent_at": sent, "ttft_s": 1.6},
                {"id": "cmpl-4", "sent_at": sent, "ttft_s": 1.0},   # no events at all
                {"id": "cmpl-5", "sent_at": sent, "ttft_s": 2.0}]
    events += _events("cmpl-5", sent)
    b = ttft_breakdown(requests, events)
    assert (b["explained"], b["sent"]) == (1, 3)
    assert [r["id"] for r in b["requests"]] == ["cmpl-5"]
    assert b["median"]["ttft_s"] == 2.0
    assert b["median_share"]["load_s"] == pytest.approx(0.5)
    text = format_breakdown(b)
    assert "1 of 3 requests" in text and "load_s" in text


def test_a_response_id_matches_its_own_request_only():
    sent = 1000.0
    events = _events("cmpl-10", sent)
    assert request_breakdown({"id": "cmpl-1", "sent_at": sent, "ttft_s": 1.6}, events) is None
    assert "none of 1" in format_breakdown(ttft_breakdown([{"id": "cmpl-1", "sent_at": sent, "ttft_s": 1.0}],
                                                          events))
