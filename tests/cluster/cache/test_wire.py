"""The agent link's promises (cluster.cache.wire, issue 31), over a socketpair with a scripted
peer (no agent process): every send and every frame's receive has a deadline, a peer that stops
sending (no answer, no heartbeat) is found stuck within ``stuck_after_s``, and frames over the
size or nesting limits close the link — none of these leaves a caller blocked or the link
claiming to be up. Hang guards are at least 5x the deadline under test; nothing is timed."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from cluster.cache.wire import (
    MAX_JSON_DEPTH,
    AgentLink,
    Idle,
    WireError,
    check_nesting,
    recv_frame,
    send_frame,
    set_io_timeout,
)
from tests.factories import returns_within

pytestmark = pytest.mark.unit


class _Proc:
    """What the link asks of the agent process: wait and kill."""

    def __init__(self) -> None:
        self.killed = threading.Event()

    def wait(self, timeout=None):
        if not self.killed.wait(timeout):
            import subprocess

            raise subprocess.TimeoutExpired("agent", timeout)
        return -9

    def kill(self) -> None:
        self.killed.set()


def _link(io_timeout_s=0.2, stuck_after_s=60.0, **kw):
    ours, peer = socket.socketpair()
    closed = threading.Event()
    proc = _Proc()
    link = AgentLink(proc, ours, 4242, lambda _link: closed.set(), io_timeout_s=io_timeout_s,
                     stuck_after_s=stuck_after_s, **kw)
    return link, peer, closed, proc


def _raw_frame(body: bytes, sizes=()) -> bytes:
    return struct.pack("<II", len(body), len(sizes)) + body + b"".join(struct.pack("<Q", n) for n in sizes)


def test_a_peer_that_never_reads_ends_the_send_by_its_deadline_and_closes_the_link():
    """The agent stopped reading: the send blocks on a full socket buffer; before the fix it
    blocked forever under the send lock (vLLM's scheduler thread among the callers)."""
    link, peer, closed, proc = _link(io_timeout_s=0.2)
    with peer:
        big = bytearray(64 << 20)  # far more than a socket buffer holds
        with pytest.raises(ConnectionError):
            returns_within(link.call, {"op": "put"}, [big], hang_s=10, what="send past its deadline")
        assert closed.is_set() and link.closed and "send" in link.why_closed
        assert proc.killed.wait(10), "a link whose send failed kills its agent at once"
        with pytest.raises(ConnectionError):
            link.call({"op": "lookup"})


def test_a_quiet_agent_is_stuck_and_its_pending_calls_fail():
    """No answer and no heartbeat for stuck_after_s (a SIGSTOPped agent): the watchdog closes
    the link, fails what waits and kills the agent; heartbeats keep a slow agent's link up."""
    link, peer, closed, proc = _link(io_timeout_s=0.2, stuck_after_s=1.0)
    with peer:
        fut = link.call({"op": "lookup", "keys": []})
        with pytest.raises(ConnectionError):
            fut.result(timeout=15)
        assert closed.wait(15) and "stuck" in link.why_closed and proc.killed.wait(10)

    link, peer, closed, _ = _link(io_timeout_s=0.2, stuck_after_s=1.0)
    with peer:
        lock = threading.Lock()
        for n in range(12):  # 3 s of heartbeats, 0.25 s apart
            send_frame(peer, lock, {"beat": n})
            assert not closed.wait(0.25), "a beating agent is not stuck"
        link.close()


@pytest.mark.parametrize("what", ["oversized buffer", "too many buffers", "deep JSON", "not an object"])
def test_a_frame_over_the_limits_closes_the_link_without_allocating(what):
    """Before the fix the reader thread died on a MemoryError (a buffer allocated before its
    data) or a RecursionError (deeply nested JSON) while the link still said up."""
    link, peer, closed, _ = _link(io_timeout_s=0.5, max_buffer_bytes=1 << 20)
    with peer:
        fut = link.call({"op": "objects", "keys": []})
        body = json.dumps({"id": 1, "ok": True, "result": [True]}).encode()
        frame = {"oversized buffer": _raw_frame(body, [3 << 30]),  # 3 GiB claimed, 1 MiB allowed
                 "too many buffers": struct.pack("<II", len(body), 9000) + body,
                 "deep JSON": _raw_frame(b"[" * 200_000 + b"]" * 200_000),
                 "not an object": _raw_frame(b"[1]")}[what]
        peer.sendall(frame)
        assert closed.wait(15), f"{what}: the link must close"
        assert link.closed
        with pytest.raises(ConnectionError):
            fut.result(timeout=5)


def test_a_frame_that_stops_half_way_is_an_error_and_quiet_between_frames_is_idle():
    a, b = socket.socketpair()
    with a, b:
        set_io_timeout(b, 0.2)
        with pytest.raises(Idle):
            recv_frame(b)  # nothing at all: quiet, not an error
        a.sendall(_raw_frame(b'{"id":1}')[:-3])
        with pytest.raises(WireError, match="stopped arriving"):
            returns_within(recv_frame, b, hang_s=5)
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, threading.Lock(), {"id": 2, "ok": True}, [b"kv"])
        set_io_timeout(b, 0.2)
        message, buffers = recv_frame(b, max_buffer_bytes=2)
        assert message == {"id": 2, "ok": True} and [bytes(x) for x in buffers] == [b"kv"]


def test_nesting_is_checked_outside_strings():
    check_nesting(json.dumps({"keys": ["[[[[" * 50], "runs": [[[0, 5]]]}).encode())
    check_nesting(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
    with pytest.raises(WireError, match="nests deeper"):
        check_nesting(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))
    with pytest.raises(WireError, match="nests deeper"):
        check_nesting(b'{"a":"\\"",' + b'"b":' + b"[" * 40 + b"]" * 40 + b"}")


def test_answers_and_heartbeats_reach_the_right_callers():
    link, peer, closed, _ = _link(io_timeout_s=0.5)
    with peer:
        set_io_timeout(peer, 5)
        fut = link.call({"op": "lookup", "keys": ["k"]})
        message, _ = recv_frame(peer)
        lock = threading.Lock()
        send_frame(peer, lock, {"beat": 1})
        send_frame(peer, lock, {"id": message["id"], "ok": True, "result": [None]}, [b"x"])
        result, buffers = fut.result(timeout=10)
        assert result == [None] and [bytes(b) for b in buffers] == [b"x"]
        assert not closed.is_set()
        link.close()
    assert closed.is_set()


def test_a_large_frame_that_keeps_moving_is_not_cut_by_the_send_deadline():
    """The deadline bounds a send's lack of progress, not its length: 16 MiB read by a slow but
    steady peer (one socket buffer every 0.01 s, ~1 s in all) goes through a link whose
    io_timeout_s is 0.2 s (a whole sendall bounded by 0.2 s cut such frames and killed a
    healthy agent)."""
    import time

    link, peer, closed, _ = _link(io_timeout_s=0.2)
    with peer:
        got = []

        def slow_reader():
            peer.settimeout(10)
            total = 0
            while total < (16 << 20):
                chunk = peer.recv(4 << 20)
                if not chunk:
                    break
                total += len(chunk)
                time.sleep(0.01)
            got.append(total)

        t = threading.Thread(target=slow_reader, daemon=True)
        t.start()
        link.call({"op": "put"}, [bytearray(16 << 20)])
        t.join(60)
        assert got and got[0] >= 16 << 20 and not closed.is_set()
        link.close()


def test_a_link_lost_before_its_client_stored_it_is_not_kept_as_live(monkeypatch):
    """The agent died right after its hello (its link closed before its transport stored it):
    the client counts it lost and serves its fallback, instead of keeping a dead link that
    refused every later call and was never replaced."""
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from tests.factories import NAMESPACE, make_key

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    client = agent_client(cfg, NAMESPACE, LocalCacheClient())
    try:
        link, peer, _, _ = _link()
        peer.close()  # the agent is gone: the reader closes the link at once
        assert returns_within(lambda: [link.closed or threading.Event().wait(0.05) for _ in range(200)]
                              and link.closed, hang_s=30)
        monkeypatch.setattr(client.transports[0], "_address", lambda: "127.0.0.1:2")
        monkeypatch.setattr(client.transports[0], "_spawn", lambda timeout_s, shards_wait_s: (link, "1 shard(s)"))
        client.transports[0]._start(5.0)
        assert not client.transports[0].up and client.counters["agent_exits"] == 1
        assert client.lookup([make_key(1)]) == [None]  # the fallback answers
    finally:
        monkeypatch.undo()
        client.close()


def test_an_unreachable_head_is_probed_every_second_and_a_failed_agent_backs_off(monkeypatch):
    """Issue 35: while the Ray address does not answer, the next start comes BACKOFF_S[0] after
    the last probe (a TCP connect each), so a head restarted on its fixed port is found within a
    second of the next call; agents that start and fail (no shards, ...) double the back-off up
    to BACKOFF_S[1], and an unreachable address starts it over. Background starts ask the agent
    to wait for shards; the constructor's start (vLLM's start-up waits for it) does not."""
    import time

    from cluster.cache import agent_life
    from cluster.cache.agent_life import BACKOFF_S, SHARDS_WAIT_S
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from tests.factories import NAMESPACE

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    client = agent_client(cfg, NAMESPACE, LocalCacheClient())  # 127.0.0.1:1 refuses: no spawn
    client.transports[0]._stop.set()  # its watcher ends: the starts below are this test's alone
    try:
        def wait_after_start() -> float:
            return client.transports[0]._next_start - time.monotonic()

        assert not client.transports[0].up and 0 < wait_after_start() <= BACKOFF_S[0]
        for _ in range(3):  # still down: a probe a second, never more
            client.transports[0]._start(5.0)
            assert 0 < wait_after_start() <= BACKOFF_S[0]
        asked = []
        monkeypatch.setattr(client.transports[0], "_address", lambda: "127.0.0.1:2")
        monkeypatch.setattr(client.transports[0], "_spawn", lambda timeout_s, shards_wait_s: (
            asked.append(shards_wait_s), (None, "no cache shards"))[1])
        waits = []
        for _ in range(7):
            client.transports[0]._start(5.0)
            waits.append(wait_after_start())
        assert waits[0] <= BACKOFF_S[0] and all(b > a for a, b in zip(waits[:4], waits[1:5], strict=True))
        assert max(waits) <= BACKOFF_S[1] and waits[-1] > BACKOFF_S[1] / 2
        monkeypatch.setattr(client.transports[0], "_address", lambda: None)
        client.transports[0]._start(5.0)
        assert 0 < wait_after_start() <= BACKOFF_S[0] and client.transports[0]._backoff == BACKOFF_S[0]

        # a call while down starts the next agent in the background, asking it to wait for shards
        monkeypatch.setattr(client.transports[0], "_address", lambda: "127.0.0.1:2")
        client.transports[0]._next_start = 0.0
        asked.clear()
        assert client.transports[0]._agent() is None
        assert returns_within(lambda: [asked or time.sleep(0.05) for _ in range(400)] and asked, hang_s=30)
        assert asked == [SHARDS_WAIT_S] and agent_life.SHARDS_WAIT_S > 0
    finally:
        monkeypatch.undo()
        client.close()


def test_the_watcher_starts_an_agent_without_a_call(monkeypatch):
    """Issue 35: with no request arriving, the client's watcher still probes and starts the
    next agent once the back-off is over (the first request after a head is back hits), asking
    it to wait for shards; it stops with the client."""
    import time

    from cluster.cache.agent_life import SHARDS_WAIT_S
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from tests.factories import NAMESPACE

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    client = agent_client(cfg, NAMESPACE, LocalCacheClient())
    asked = []
    try:
        monkeypatch.setattr(client.transports[0], "_address", lambda: "127.0.0.1:2")
        monkeypatch.setattr(client.transports[0], "_spawn", lambda timeout_s, shards_wait_s: (
            asked.append(shards_wait_s), (None, "no cache shards"))[1])
        assert returns_within(lambda: [asked or time.sleep(0.05) for _ in range(600)] and asked, hang_s=60)
        assert asked[0] == SHARDS_WAIT_S and client.counters["agent_down_calls"] == 0  # no call made
    finally:
        client.close()
        monkeypatch.undo()
    n = len(asked)
    time.sleep(2.5)  # past two watcher periods: none after close (not a timing assertion on the code)
    assert len(asked) <= n + 1 and client.transports[0]._stop.is_set()
