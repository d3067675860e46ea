"""The connector's store queue is bounded (issue #20): with a client whose put blocks, the
puts waiting for the I/O thread stop at the bound, the newest stores are dropped (no canonical
compute for a dropped segment), counted ``store_dropped`` and warned about once; vLLM's
threads never wait. No vLLM and no Ray: the client, the model and the counters are stand-ins.
The only timing is a hang guard: each call must return within 10 s.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest
import torch

from cluster.vllm import store_queue as sq
from cluster.vllm.events import EventLog, WarnOnce, read_events
from tests.factories import HANG_S, make_key, returns_within

pytestmark = pytest.mark.unit

SHAPE = (2, 2, 4, 2, 8)  # [L, 2, T, H, D] of every segment: 4 tokens, 1 KiB in float32




class _BlockingClient:
    """A cache client whose puts block until released; nothing is cached yet."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.put_keys: list = []

    def contains(self, keys):
        return [False] * len(keys)

    def put(self, key, kv, positions=None):
        assert self.release.wait(HANG_S * 3)
        self.put_keys.append(key)

    def flush(self, timeout_s=60.0):
        return True


class _Counters:
    """Counters that take any name (the real ones need vLLM)."""

    def __init__(self) -> None:
        self.totals: Counter = Counter()

    def bump(self, **deltas):
        self.totals.update(deltas)


@pytest.fixture
def queue(tmp_path):
    client = _BlockingClient()
    computed: list = []

    def canonical_kv(ids):
        computed.append(tuple(ids))
        return torch.zeros(SHAPE)

    q = sq.StoreQueue(client, canonical_kv=canonical_kv, remember=lambda key, kv: None,
                      counters=_Counters(), events=EventLog(str(tmp_path / "events.jsonl")),
                      warn=WarnOnce())
    yield q, client, computed, str(tmp_path / "events.jsonl")
    client.release.set()
    q.shutdown()


def _segments(n: int, start: int = 0):
    return [(make_key(start + i), tuple(range(start + i, start + i + 4))) for i in range(n)]


def test_segments_past_the_bound_are_dropped_uncomputed_and_counted(queue, monkeypatch, caplog):
    q, client, computed, events_path = queue
    cap = 3
    # raising=False: the code before the bound has no such constant (and no bound)
    monkeypatch.setattr(sq, "MAX_STORE_IO_ITEMS", cap, raising=False)
    segs = _segments(10)
    q.add("r1", segs, now=0.0)
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        returns_within(q.drain, False, None)  # the client's puts block: drain must not
        q.add("r2", _segments(4, start=100), now=0.0)
        returns_within(q.drain, False, None)
    assert len(computed) == cap  # only the segments whose puts were queued ran the model
    assert q._counters.totals["store_dropped"] == 10 + 4 - cap
    assert q.store_dropped == 10 + 4 - cap
    warned = [r for r in caplog.records if "store_dropped" in r.getMessage()]
    assert len(warned) == 1
    # vLLM may free both requests' blocks: their segments are all computed or dropped
    assert returns_within(q.finished_sending, {"r1", "r2"}) == {"r1", "r2"}

    client.release.set()  # flush waits for the stores that were queued: the oldest
    assert returns_within(q.flush, HANG_S) is True
    assert client.put_keys == [k for k, _ in segs[:cap]]
    stores = {e["request_id"]: e for e in read_events(events_path) if e["event"] == "store"}
    assert (stores["r1"]["stored"], stores["r1"]["dropped"]) == (cap, 10 - cap)
    assert (stores["r2"]["stored"], stores["r2"]["dropped"]) == (0, 4)

    q.add("r3", _segments(2, start=200), now=0.0)  # room again: stored
    returns_within(q.drain, False, None)
    assert returns_within(q.flush, HANG_S) is True
    assert client.put_keys[-2:] == [k for k, _ in _segments(2, start=200)]
    assert q.store_dropped == 10 + 4 - cap


def test_a_prefix_batch_past_the_byte_bound_is_dropped_whole(queue, monkeypatch):
    q, client, _, events_path = queue
    size = torch.zeros(SHAPE).nbytes
    monkeypatch.setattr(sq, "MAX_STORE_IO_BYTES", int(2.5 * size), raising=False)
    first = [(k, torch.zeros(SHAPE)) for k, _ in _segments(2)]
    second = [(k, torch.zeros(SHAPE)) for k, _ in _segments(1, start=50)]
    returns_within(q.put_prefix, "p1", first)   # 2 chunks queued (the first put blocks)
    returns_within(q.put_prefix, "p2", second)  # a third would pass 2.5 chunks: dropped
    assert q._counters.totals["store_dropped"] == 1
    client.release.set()
    assert returns_within(q.flush, HANG_S) is True
    assert client.put_keys == [k for k, _ in first]
    stores = {e["request_id"]: e for e in read_events(events_path) if e["event"] == "store"}
    assert (stores["p1"]["stored"], stores["p1"]["dropped"]) == (2, 0)
    assert (stores["p2"]["stored"], stores["p2"]["dropped"]) == (0, 1)


def test_a_batch_over_the_bound_alone_is_still_stored(queue, monkeypatch):
    q, client, _, _ = queue
    monkeypatch.setattr(sq, "MAX_STORE_IO_ITEMS", 1, raising=False)
    batch = [(k, torch.zeros(SHAPE)) for k, _ in _segments(3)]
    client.release.set()
    returns_within(q.put_prefix, "p1", batch)
    assert returns_within(q.flush, HANG_S) is True
    assert client.put_keys == [k for k, _ in batch]
    assert q._counters.totals["store_dropped"] == 0


def test_a_finished_requests_blocks_are_released_within_the_hold_bound(queue):
    """vLLM finished ``r1`` while its three segments were still queued: its blocks are held
    until ``MAX_BLOCK_HOLD_S`` after the finish, then reported once (counted, warned); the
    segments stay queued and are still computed and put in later steps. Before, the blocks
    stayed held for as long as the queue took."""
    q, client, computed, events_path = queue
    client.release.set()
    segs = _segments(3, start=300)
    q.add("r1", segs, now=0.0)
    assert q.finished_sending({"r1"}, now=0.0) == set()
    assert q.finished_sending(set(), now=sq.MAX_BLOCK_HOLD_S - 0.1) == set()
    assert q.finished_sending(set(), now=sq.MAX_BLOCK_HOLD_S) == {"r1"}
    assert q.released_early == 1
    returns_within(q.drain, False, None)  # a later step: the stores go on
    assert returns_within(q.flush, HANG_S) is True
    assert computed == [ids for _, ids in segs] and client.put_keys == [k for k, _ in segs]
    assert q.finished_sending(set(), now=100.0) == set()  # reported once
    assert not q._done and not q._finished_at and not q._released  # nothing left behind
    stores = [e for e in read_events(events_path) if e["event"] == "store"]
    assert [(e["request_id"], e["stored"]) for e in stores] == [("r1", 3)]


def test_a_request_whose_stores_finish_in_time_is_reported_when_done(queue):
    q, client, _, _ = queue
    client.release.set()
    q.add("r2", _segments(2, start=400), now=0.0)
    assert q.finished_sending({"r2"}, now=0.0) == set()
    returns_within(q.drain, False, None)
    assert q.finished_sending(set(), now=1.0) == {"r2"}
    assert q.released_early == 0 and not q._done
