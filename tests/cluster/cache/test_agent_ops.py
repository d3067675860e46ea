"""The agent's op table (:mod:`cluster.cache.agent_ops`): both ends dispatch from it, and an
answer that does not match its declared type is a miss on the vLLM side, never an exception."""

from __future__ import annotations

import socket
from concurrent.futures import Future

import pytest

from cluster.cache.agent import Agent
from cluster.cache.agent_ops import OPS, LookupHit, ObjectsAnswer, request
from tests.factories import make_key

pytestmark = pytest.mark.unit


def test_every_declared_op_has_a_handler_and_nothing_else_is_answered():
    ours, theirs = socket.socketpair()
    try:
        agent = Agent(ours)
        assert set(agent.handlers) == set(OPS)
        handlers = {n[3:] for n in dir(agent) if n.startswith("op_")}
        assert handlers == set(OPS), "a handler the table does not declare would never be reached"
        with pytest.raises(ValueError, match="unknown agent op"):
            agent.run({"op": "exec", "keys": []}, [])
    finally:
        ours.close()
        theirs.close()


def test_lanes_keep_writes_ordered():
    assert {n for n, op in OPS.items() if op.ordered} == {"put", "flush", "delete", "clear"}
    assert {n for n, op in OPS.items() if op.buffers} == {"put", "objects"}


def test_request_refuses_unknown_ops_and_fields():
    key = make_key(7)
    assert request("flush", timeout_s=2.0) == {"op": "flush", "keys": [], "timeout_s": 2.0}
    assert request("lookup", [key])["keys"] == [str(key)]
    with pytest.raises(ValueError, match="unknown agent op"):
        request("lookups", [key])
    with pytest.raises(ValueError, match="takes no field"):
        request("lookup", [key], slots=[[0, 1]])


def test_lookup_hits_round_trip_and_malformed_ones_are_misses():
    hit = LookupHit(6, ((0, 4), (10, 2)), "disk", 4096)
    assert LookupHit.from_wire(hit.to_wire()) == hit
    assert hit.positions() == (0, 1, 2, 3, 10, 11)
    wire = hit.to_wire()
    for bad in (None, [6, [[0, 6]], "host", 1], {**wire, "tokens": 7}, {**wire, "tokens": True},
                {**wire, "runs": [[0, 0], [0, 6]]}, {**wire, "runs": "0-6"}, {**wire, "bound": "big"},
                {**wire, "runs": [[-1, 6]]}, {**wire, "bound": -1}, {**wire, "tier": 3},
                {k: v for k, v in wire.items() if k != "tier"}):
        assert LookupHit.from_wire(bad) is None, bad


def test_objects_answers_must_match_the_request():
    good = ObjectsAnswer(("host", None, "refit"), (100, None, 9000))
    assert ObjectsAnswer.from_wire(good.to_wire(), 3) == good
    for bad, n in ((good.to_wire(), 2), ({"where": ["host"]}, 1), ({"where": ["mine"], "sizes": [1]}, 1),
                   ({"where": ["host"], "sizes": [-1]}, 1), ({"where": ["host"], "sizes": ["1"]}, 1), ([], 0)):
        assert ObjectsAnswer.from_wire(bad, n) is None, bad


class _Link:
    """An agent link answering each call with ``answer``."""

    pid, arena, closed = 1, False, False

    def __init__(self, answer) -> None:
        self.answer = answer
        self.sent = []

    def call(self, message, buffers=()):
        self.sent.append((message, list(buffers)))
        fut = Future()
        fut.set_result((self.answer, []))
        return fut

    def close(self) -> None:
        self.closed = True


def test_a_malformed_lookup_answer_is_a_counted_miss_and_a_put_sends_one_encoded_object(monkeypatch):
    import torch

    from cluster.cache.agent_client import AgentClient
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from tests.factories import NAMESPACE
    from tiers.format import parse_header

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    client = AgentClient(cfg, NAMESPACE, LocalCacheClient(), start_timeout_s=0.1)
    try:
        keys = [make_key(8100), make_key(8101), make_key(8102)]
        good = LookupHit(4, ((0, 4),), "host", 512).to_wire()
        monkeypatch.setattr(client, "_link", _Link([good, {"tokens": "4"}, None]))
        metas = client.lookup(keys)
        assert metas[0] is not None and metas[0].positions == (0, 1, 2, 3)
        assert metas[1:] == [None, None]
        assert client.counters["agent_errors"] == 1 and client.counters["hits"] == 1

        link = _Link(None)
        monkeypatch.setattr(client, "_link", link)
        kv = torch.randn(2, 2, 4, 1, 8, dtype=torch.float16)
        client.put(keys[0], kv, range(4))
        ((message, buffers),) = link.sent
        assert message == request("put", [keys[0]]) and len(buffers) == 1
        header = parse_header(memoryview(buffers[0]), expected_key=keys[0])
        assert (header.num_layers, header.num_tokens) == (2, 4), "the object goes as encoded here"
        with pytest.raises(ValueError):
            client.put(keys[1], kv[0])
    finally:
        client.close()


def test_admin_answers_must_have_their_type():
    from cluster.cache.agent_ops import answer_of

    assert answer_of("contains", [True, False], 2) == [True, False]
    for bad in ([True], [1, 0], "yes", None, {"a": True}):
        assert answer_of("contains", bad, 2) is None, bad
    assert answer_of("flush", True) is True and answer_of("flush", 1) is None
    assert answer_of("delete", 3) == 3 and answer_of("clear", 0) == 0
    for bad in (-1, True, "3", 2.0, None):
        assert answer_of("delete", bad) is None and answer_of("clear", bad) is None, bad
    with pytest.raises(ValueError):
        answer_of("lookup", [])


@pytest.mark.parametrize("answer", [["yes", "no"], [True], -1, "3", None, {"x": 1}])
def test_a_malformed_admin_answer_is_a_counted_no(monkeypatch, answer):
    """``contains``, ``delete``, ``clear`` and ``flush`` answered with the wrong type: False / 0
    and one ``agent_errors`` each, never an exception or a truthy string counted as stored."""
    from cluster.cache.agent_client import AgentClient
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from tests.factories import NAMESPACE

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    client = AgentClient(cfg, NAMESPACE, LocalCacheClient(), start_timeout_s=0.1)
    try:
        monkeypatch.setattr(client, "_link", _Link(answer))
        keys = [make_key(8200), make_key(8201)]
        assert client.contains(keys) == [False, False]
        assert client.delete(keys) == 0 and client.clear() == 0 and client.flush(1.0) is False
        assert client.counters["agent_errors"] == 4
    finally:
        client.close()


def test_a_put_over_the_pending_bound_is_dropped_before_it_is_encoded(monkeypatch):
    import torch

    from cluster.cache import agent_client
    from cluster.cache.agent_client import AgentClient
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from tests.factories import NAMESPACE

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    client = AgentClient(cfg, NAMESPACE, LocalCacheClient(), start_timeout_s=0.1)
    try:
        link = _Link(None)
        monkeypatch.setattr(client, "_link", link)
        monkeypatch.setattr(agent_client, "encode_kv", lambda *a, **k: pytest.fail("encoded"))
        client._put_bytes = agent_client.MAX_PENDING_PUT_BYTES - 10
        client.put(make_key(8300), torch.zeros(2, 2, 4, 1, 8, dtype=torch.float16), range(4))
        assert client.counters["puts_dropped"] == 1 and not link.sent
    finally:
        client.close()
