"""The op table (:mod:`cluster.cache.ops`): both ends of the agent link dispatch from it, each
op's request and answer have one type, and an answer that does not match its type is a miss on
the vLLM side, never an exception."""

from __future__ import annotations

import socket
from concurrent.futures import Future

import pytest

from cluster.cache.agent import Agent
from cluster.cache.ops import (
    OPS,
    ClearRequest,
    FlushRequest,
    KeysRequest,
    LookupAnswer,
    LookupHit,
    LookupRequest,
    ObjectsRequest,
    PutRequest,
    SlotsAnswer,
    request_frame,
)
from tests.factories import NAMESPACE, make_key

pytestmark = pytest.mark.unit


def test_every_declared_op_has_a_handler_and_nothing_else_is_answered():
    ours, theirs = socket.socketpair()
    try:
        agent = Agent(ours)
        assert set(agent.handlers) == set(OPS)
        own = {n[3:] for n in dir(agent) if n.startswith("op_")}
        assert own <= set(OPS), "a handler the table does not declare would never be reached"
        with pytest.raises(ValueError, match="unknown agent op"):
            agent.run({"op": "exec", "keys": []}, [])
        with pytest.raises(ValueError):  # a malformed request: an error answer, nothing run
            agent.run({"op": "lookup", "keys": ["not a key"]}, [])
    finally:
        ours.close()
        theirs.close()


def test_lanes_keep_writes_ordered():
    assert {n for n, op in OPS.items() if op.ordered} == {"put", "flush", "delete", "clear"}
    assert {n for n, op in OPS.items() if op.buffers} == {"put", "objects"}


def test_requests_round_trip_and_frames_refuse_unknown_ops_and_types():
    key = make_key(7)
    for op, req in (("lookup", LookupRequest((key,), (True,))), ("contains", KeysRequest((key,))),
                    ("objects", ObjectsRequest((key,), 2.0, slots=((0, 4096),))),
                    ("put", PutRequest(key, b"obj")), ("flush", FlushRequest(2.0)),
                    ("clear", ClearRequest("ns", stale=True))):
        message, buffers = request_frame(op, req)
        assert message["op"] == op and OPS[op].request.from_wire(message, buffers) == req
    with pytest.raises(ValueError, match="unknown op"):
        request_frame("lookups", LookupRequest((key,)))
    with pytest.raises(ValueError, match="takes a LookupRequest"):
        request_frame("lookup", KeysRequest((key,)))
    for bad in ({"keys": [str(key)], "known": [1]}, {"keys": [str(key)], "known": [True, False]},
                {"keys": "k"}, {"keys": [7]}, {"keys": [[str(key)]]}, {"keys": [{"a": 1}]},
                {"keys": ["not a key"]}, {"keys": ["ns/seg/a/b"]}):
        with pytest.raises(ValueError):
            LookupRequest.from_wire(bad, [])
    with pytest.raises(ValueError):
        PutRequest.from_wire({"keys": [str(key), str(key)]}, [b"a"])
    with pytest.raises(ValueError):
        ObjectsRequest.from_wire({"keys": [str(key)], "slots": [[0, "4"]]}, [])


def test_parsed_keys_are_kept_and_equal_to_a_fresh_parse_and_a_malformed_one_raises_each_time():
    key = make_key(3)
    first = LookupRequest.from_wire({"keys": [str(key)]}, []).keys[0]
    again = LookupRequest.from_wire({"keys": [str(key)]}, []).keys[0]
    assert first == key == again and hash(first) == hash(key) and str(first) == str(key)
    for _ in range(2):
        with pytest.raises(ValueError):
            LookupRequest.from_wire({"keys": [str(key).replace("/", ".")]}, [])


def test_lookup_answers_round_trip_and_malformed_ones_are_misses():
    keys = (make_key(1), make_key(2), make_key(3))
    answer = LookupAnswer((LookupHit("disk", b"header", "shard-0"), None, LookupHit("host", b"", "shard-1")), (1,))
    value, buffers = answer.to_wire()
    assert buffers == [b"header"]  # none for a header the client holds
    assert LookupAnswer.from_wire(value, buffers, LookupRequest(keys)) == answer
    for bad, bufs in (({**value, "hits": value["hits"][:2]}, buffers), (value, []), (value, buffers + [b"x"]),
                      ({**value, "unanswered": [3]}, buffers), ({**value, "unanswered": ["1"]}, buffers),
                      ({"hits": [{"tier": 3, "source": "", "header": True}, None, None], "unanswered": []}, [b"h"]),
                      ({"hits": [{"tier": "host", "header": False}, None, None], "unanswered": []}, []),
                      ({"hits": [{"tier": "host", "source": ""}, None, None], "unanswered": []}, []),
                      (None, []), ([], [])):
        assert LookupAnswer.from_wire(bad, bufs, LookupRequest(keys)) is None, bad


def test_slots_answers_must_match_the_request():
    keys = (make_key(1), make_key(2), make_key(3))
    slotted = ObjectsRequest(keys, 1.0, slots=((0, 1), (1, 1), (2, 1)))
    good = SlotsAnswer(("host", None, "refit"), (100, None, 9000))
    assert SlotsAnswer.from_wire(good.to_wire()[0], [], slotted) == good
    for bad in (good.to_wire()[0] | {"where": ["host", None]}, {"where": ["host"] * 3}, {"where": ["shared", None, None], "sizes": [1, None, None]},
                {"where": ["host"] * 3, "sizes": [-1, 1, 1]}, {"where": ["host"] * 3, "sizes": ["1", 1, 1]}, []):
        assert SlotsAnswer.from_wire(bad, [], slotted) is None, bad
    bare = ObjectsRequest(keys, 1.0)  # no arena: one buffer per object sent
    assert SlotsAnswer.from_wire(good.to_wire()[0], [b"obj"], bare) == good
    assert SlotsAnswer.from_wire(good.to_wire()[0], [], bare) is None


def test_admin_answers_must_have_their_type():
    key = KeysRequest((make_key(1), make_key(2)))
    assert OPS["contains"].answer([True, False], [], key) == (True, False)
    for bad in ([True], [1, 0], "yes", None, {"a": True}):
        assert OPS["contains"].answer(bad, [], key) is None, bad
    assert OPS["flush"].answer(True, [], None) is True and OPS["flush"].answer(1, [], None) is None
    assert OPS["put"].answer(False, [], None) is False and OPS["put"].answer(None, [], None) is None
    assert OPS["delete"].answer(3, [], key) == 3 and OPS["clear"].answer(0, [], None) == 0
    for bad in (-1, True, "3", 2.0, None):
        assert OPS["delete"].answer(bad, [], key) is None and OPS["clear"].answer(bad, [], None) is None, bad
    assert OPS["stats"].answer({"shards": {}}, [], None) == {"shards": {}} and OPS["stats"].answer([], [], None) is None


class _Link:
    """An agent link answering each call with ``answer`` (and its buffers)."""

    pid, arena, closed = 1, False, False

    def __init__(self, answer, buffers=()) -> None:
        self.answer, self.buffers = answer, list(buffers)
        self.sent = []

    def call(self, message, buffers=()):
        self.sent.append((message, list(buffers)))
        fut = Future()
        fut.set_result((self.answer, self.buffers))
        return fut

    def close(self) -> None:
        self.closed = True


def _agent_chain():
    """A client over the agent chain whose agent never started (nothing listens)."""
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    return agent_client(cfg, NAMESPACE, LocalCacheClient(), start_timeout_s=0.1)


def test_a_malformed_lookup_answer_is_a_counted_miss_and_a_put_sends_one_encoded_object(monkeypatch):
    import torch

    from tests.factories import make_object, shard_kv
    from tiers.format import parse_header

    client = _agent_chain()
    try:
        keys = [make_key(8100), make_key(8101), make_key(8102)]
        obj = make_object(keys[0], shard_kv(1))
        good = LookupAnswer((LookupHit("host", obj[:4096], "shard-0"), LookupHit("host", b"junk", "shard-0"), None))
        monkeypatch.setattr(client.transports[0], "_link", _Link(*good.to_wire()))
        metas = client.lookup(keys)
        assert metas[0] is not None and metas[0].num_tokens == shard_kv(1).shape[2]
        assert metas[1:] == [None, None] and client.counters["read_errors"] == 1  # the junk header
        monkeypatch.setattr(client.transports[0], "_link", _Link({"hits": [None]}))  # not one per key
        assert client.lookup(keys) == [None] * 3 and client.counters["agent_errors"] == 1

        link = _Link(True)
        monkeypatch.setattr(client.transports[0], "_link", link)
        kv = torch.randn(2, 2, 4, 1, 8, dtype=torch.float16)
        client.put(keys[1], kv, range(4))
        ((message, buffers),) = link.sent
        assert message == request_frame("put", PutRequest(keys[1], b""))[0] and len(buffers) == 1
        header = parse_header(memoryview(buffers[0]), expected_key=keys[1])
        assert (header.num_layers, header.num_tokens) == (2, 4), "the object goes as encoded here"
        assert client.counters["puts"] == 1 and client._bound.calls == 0  # settled: the bound is free
        with pytest.raises(ValueError):
            client.put(keys[2], kv[0])
    finally:
        client.close()


@pytest.mark.parametrize("answer", [["yes", "no"], [True], -1, "3", None, {"x": 1}])
def test_a_malformed_admin_answer_is_a_counted_no(monkeypatch, answer):
    """``contains``, ``delete``, ``clear`` and ``flush`` answered with the wrong type: False / 0
    and one ``agent_errors`` each, never an exception or a truthy string counted as stored."""
    client = _agent_chain()
    try:
        monkeypatch.setattr(client.transports[0], "_link", _Link(answer))
        keys = [make_key(8200), make_key(8201)]
        assert client.contains(keys) == [False, False]
        assert client.delete(keys) == 0 and client.clear() == 0 and client.flush(1.0) is False
        assert client.counters["agent_errors"] == 4
    finally:
        client.close()
