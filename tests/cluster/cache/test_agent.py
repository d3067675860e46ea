"""The client over the agent chain (a real cache agent process on the session Ray cluster, then
a machine-local fallback): round trips equal to the Ray client's bytes, a lost agent serves the
fallback and a new one takes over, the wire's limits, and a cluster that never answers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import pytest
import torch

from tests.factories import NAMESPACE, make_key, make_prefix_key, returns_within, shard_kv


@pytest.mark.cluster
def test_agent_round_trip_then_lost_agent_falls_back_and_reconnects(kvconfig, shards):
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient

    fallback = LocalCacheClient()
    client = agent_client(kvconfig, NAMESPACE, fallback)
    try:
        assert client.transports[0].up, "the first agent starts within the constructor"
        pid = client.transports[0]._link.pid
        assert pid != os.getpid()
        keys = [make_prefix_key(97300 + i) for i in range(5)]  # segments' positions are canonical
        kvs = [shard_kv(i, num_tokens=6 + i) for i in range(5)]
        for k, kv in zip(keys, kvs, strict=True):
            client.put(k, kv, positions=range(3, 3 + kv.shape[2]))
        assert client.flush(30)
        metas = client.lookup(keys + [make_key(97399)])
        assert metas[-1] is None
        for k, kv, m in zip(keys, kvs, metas[:-1], strict=True):
            assert m is not None and m.key == k and m.num_tokens == kv.shape[2]
            assert m.positions == tuple(range(3, 3 + kv.shape[2]))
        futs = client.fetch_layers(keys, range(kvs[0].shape[0]))
        for layer, fut in enumerate(futs):
            for kv, t in zip(kvs, fut.result(30), strict=True):
                assert t is not None and torch.equal(t, kv[layer])  # bit-exact
        got = client.fetch_layer(keys[:1], 0).result(30)[0]
        got.add_(1.0)  # the engine writing into a layer never changes the next read
        assert torch.equal(client.fetch_layer(keys[:1], 0).result(30)[0], kvs[0][0])
        assert client.contains(keys) == [True] * 5
        assert client.stats()["agent"]["up"] is True

        # the agent dies (as when Ray ends a driver whose head is gone): misses from the
        # fallback, never an exception, and a new agent after the back-off
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while client.transports[0].up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.transports[0].up
        assert client.lookup(keys) == [None] * 5
        assert [f.result(5) for f in client.fetch_layers(keys, [0])] == [[None] * 5]
        assert client.counters["agent_exits"] == 1 and client.counters["agent_down_calls"] >= 2
        while not client.transports[0].up and time.monotonic() < deadline:
            client.lookup(keys[:1])  # calls start the next agent after the back-off
            time.sleep(0.2)
        assert client.transports[0].up and client.transports[0]._link.pid != pid
        assert all(m is not None for m in client.lookup(keys)), "hits resume with the new agent"
        assert client.counters["agent_starts"] == 2
    finally:
        client.close()


@pytest.mark.unit
def test_no_ray_means_fallback_without_an_agent():
    """Nothing listens at ray_address: no agent process, the fallback serves, nothing raises."""
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from cluster.workloads.services import free_port

    cfg = load_config(environ={}, overrides={"ray_address": f"127.0.0.1:{free_port()}"})
    fallback = LocalCacheClient()
    client = returns_within(agent_client, cfg, NAMESPACE, fallback, what="an unreachable Ray")
    try:
        assert not client.transports[0].up
        key, kv = make_key(1), shard_kv(1, num_tokens=4)
        client.put(key, kv)
        assert client.lookup([key])[0] is not None  # the fallback holds it
        assert client.counters["agent_down_calls"] >= 2
    finally:
        client.close()


@pytest.mark.unit
def test_wire_refuses_frames_over_its_limits():
    from cluster.cache.wire import MAX_BUFFER_BYTES, WireError, recv_frame, send_frame

    a, b = socket.socketpair()
    with a, b:
        send_frame(a, threading.Lock(), {"op": "x"}, [b"abc", bytearray(2)])
        message, bufs = recv_frame(b)
        assert message == {"op": "x"} and [bytes(x) for x in bufs] == [b"abc", b"\0\0"]
    # a frame claiming a buffer of more than the limit: refused before allocating it
    c, d = socket.socketpair()
    with c, d:
        c.sendall((7).to_bytes(4, "little") + (1).to_bytes(4, "little") + b'{"a":1}'
                  + (MAX_BUFFER_BYTES + 1).to_bytes(8, "little"))
        with pytest.raises(WireError):
            recv_frame(d)
    e, f = socket.socketpair()
    with e, f:
        e.sendall((3).to_bytes(4, "little") + (0).to_bytes(4, "little") + b"[1]")
        with pytest.raises(WireError):  # not an object
            recv_frame(f)
        e.close()
        with pytest.raises(WireError):  # end of stream
            recv_frame(f)


@pytest.mark.cluster
def test_client_that_fell_back_reconnects_when_shards_come(kvconfig, shards):
    """Ray answers but its namespace has no shards yet: the fallback serves; once shards are
    started there, the next agent finds them and hits come from the shared cache."""
    import dataclasses
    import uuid

    from cluster.cache.factory import agent_client
    from cluster.cache.lifecycle import start_shards, stop_shards
    from cluster.cache.local import LocalCacheClient

    cluster_cfg = dataclasses.replace(kvconfig.cluster, ray_namespace=f"kvblend-late-{uuid.uuid4().hex[:6]}")
    cfg = dataclasses.replace(kvconfig, cluster=cluster_cfg)
    client = agent_client(cfg, NAMESPACE, LocalCacheClient())
    try:
        assert not client.transports[0].up  # the agent said "no shards" and exited
        started = start_shards(cfg)
        key, kv = make_key(97401), shard_kv(3, num_tokens=5)
        deadline = time.monotonic() + 120
        while not client.transports[0].up and time.monotonic() < deadline:
            client.lookup([key])
            time.sleep(0.25)
        assert client.transports[0].up and client.counters["agent_starts"] == 1
        client.put(key, kv)
        assert client.flush(30)
        assert client.lookup([key])[0] is not None
        assert torch.equal(client.fetch_layer([key], 1).result(30)[0], kv[1])
        # reset_cache's path: the agent clears the namespace on every shard
        assert client.clear(NAMESPACE) >= 1  # its copies (host, disk)
        assert client.lookup([key]) == [None]
    finally:
        client.close()
        stop_shards(cluster_cfg.ray_namespace)
    assert started


@pytest.mark.cluster
def test_a_stopped_agent_is_found_stuck_its_calls_are_misses_and_a_new_one_serves(kvconfig, shards):
    """Issue 31 item 1: the agent SIGSTOPped (alive, never answering, never reading). Lookups,
    loads and puts are misses or drops, none blocks (before: a put's send blocked forever
    once the socket buffer was full, and nothing restarted the agent); within stuck_after_s the
    link closes, the agent is killed, and after the back-off a new agent serves hits."""
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient

    client = agent_client(kvconfig, NAMESPACE, LocalCacheClient())
    try:
        assert client.transports[0].up
        key, kv = make_key(97500), shard_kv(5, num_tokens=8)
        client.put(key, kv)
        assert client.flush(30) and client.lookup([key])[0] is not None
        pid = client.transports[0]._link.pid
        os.kill(pid, signal.SIGSTOP)
        hang = 5 * (client.transports[0].stuck_after_s + client.transports[0].io_timeout_s + kvconfig.blend.load_timeout_s)
        big = shard_kv(6, num_tokens=4096)  # 2 MiB a put: a few fill the socket buffer
        for i in range(8):
            returns_within(client.put, make_key(97510 + i), big, hang_s=hang, what="put to a stopped agent")
        assert returns_within(client.lookup, [key], hang_s=hang) == [None]
        assert returns_within(lambda: client.fetch_layer([key], 0).result(hang), hang_s=hang) == [None]
        deadline = time.monotonic() + hang
        while client.transports[0].up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.transports[0].up and client.counters["agent_exits"] == 1
        with pytest.raises(ProcessLookupError):  # killed, not left stopped
            for _ in range(200):
                os.kill(pid, 0)
                time.sleep(0.05)
        while not client.transports[0].up and time.monotonic() < deadline + 60:
            client.lookup([key])  # calls start the next agent after the back-off
            time.sleep(0.2)
        assert client.transports[0].up and client.transports[0]._link.pid != pid and client.counters["agent_starts"] == 2
        assert client.lookup([key])[0] is not None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        client.close()


@pytest.mark.cluster
def test_a_cluster_folder_in_the_working_directory_is_not_run_as_the_agent(tmp_path, monkeypatch):
    """Issue 31 item 4: vLLM started where a folder named ``cluster`` exists (another project,
    or a planted one). Before, the agent ran as ``python -m cluster.cache.agent`` from that
    directory: the folder's code ran with the object key in its environment."""
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config

    marker = tmp_path / "planted-ran"
    pkg = tmp_path / "cluster" / "cache"
    pkg.mkdir(parents=True)
    (tmp_path / "cluster" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "agent.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                  "def main(argv):\n    raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1", "call_timeout_s": 1.0})
    client = agent_client(cfg, NAMESPACE, LocalCacheClient())
    try:
        assert not client.transports[0].up  # nothing listens: no agent was started by the constructor
        link, why = client.transports[0]._spawn(60.0, 0.0)  # start one by hand: the real agent says Ray is unreachable
        assert link is None and "not reachable" in why, why
        assert not marker.exists(), "the working directory's cluster/ package ran as the agent"
    finally:
        client.close()


@pytest.mark.cluster
def test_the_agent_runs_the_kvblend_this_process_runs_from_the_working_directory(monkeypatch):
    """vLLM started in a kvblend checkout that is not installed (``PYTHONPATH=.``, as on the
    GPU machine): the package root is the working directory. Before, the agent dropped it with
    every other working-directory entry and died with ``No module named 'cluster'`` (every
    call a miss); now the package this process imported is always the agent's."""
    import subprocess
    import sys

    from cluster.cache.wire import _BOOT, package_root

    monkeypatch.chdir(package_root())
    # -S: no site-packages, so kvblend is not importable as installed (its editable .pth)
    out = subprocess.run([sys.executable, "-I", "-S", "-c", _BOOT.replace("from cluster.cache.agent import main",
                                                                    "import cluster; print(cluster.__file__); main = lambda a: 0"),
                          package_root(), "", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(package_root())


def _known(client, key, kv) -> None:
    """``client`` holds ``key``'s header as a lookup through a shard would have left it."""
    from cluster.cache.headers import HeaderEntry
    from tests.factories import make_object
    from tiers.format import parse_header

    client._remember(key, HeaderEntry(parse_header(make_object(key, kv), expected_key=key), "shard-0", "host"))


@pytest.mark.unit
def test_the_objects_call_waits_no_longer_than_the_engine_waits_for_a_layer(monkeypatch):
    """Issue 31 item 5: the engine gives up on a layer at load_timeout_s; the agent's objects
    call waited 2 x call_timeout_s (4 s against 2 s by default). The wait handed to the
    answer's future is recorded by a stand-in link (no clock involved)."""
    from concurrent.futures import Future

    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config

    waits = []

    class SlowAnswer(Future):
        def result(self, timeout=None):
            waits.append(timeout)
            raise TimeoutError

    class SlowLink:
        pid, closed = 1, False

        def call(self, message, buffers=()):
            return SlowAnswer()

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1", "call_timeout_s": 1.0,
                                             "load_timeout_s": 2.0})
    client = agent_client(cfg, NAMESPACE, LocalCacheClient())
    try:
        key = make_key(97600)
        _known(client, key, shard_kv(7))  # looked up: the read asks for the object at once
        monkeypatch.setattr(client.transports[0], "_link", SlowLink())
        assert client.fetch_layer([key], 0).result(30) == [None]
        assert waits == [cfg.blend.load_timeout_s], waits
        assert client.counters["timeouts"] == 1 and client.counters["layer_misses"] == 1
    finally:
        monkeypatch.undo()
        client.close()


@pytest.mark.unit
def test_objects_from_the_agent_are_its_shards_host_memory_and_a_medium_it_may_not_name_is_a_miss(monkeypatch):
    """Issue 31 item 2, vLLM's side: the agent hands over only objects of its shards' host
    memory (checked whole as they entered it: copied unchecked here); an answer naming
    anything else (before, ``"shared"``: an object the agent read from Redis or S3) is a
    malformed answer, a counted miss. Objects only Redis or S3 hold are read by this
    process's client itself, each layer checked (test_object_auth.py)."""
    from concurrent.futures import Future

    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from tests.factories import make_object

    key, kv = make_key(97700), shard_kv(97700)
    answers = []

    class Link:
        pid, closed = 1, False

        def call(self, message, buffers=()):
            fut = Future()
            fut.set_result(answers.pop(0))
            return fut

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    for where in ("shared", "host"):
        client = agent_client(cfg, NAMESPACE, LocalCacheClient())
        try:
            _known(client, key, kv)
            monkeypatch.setattr(client.transports[0], "_link", Link())
            answers.append(({"where": [where], "sizes": [None]}, [bytearray(make_object(key, kv))]))
            got = [client.fetch_layer([key], i).result(30)[0] for i in range(kv.shape[0])]
            if where == "shared":
                assert got == [None] * kv.shape[0] and client.counters["agent_errors"] >= 1 and not answers
            else:
                assert all(torch.equal(t, kv[i]) for i, t in enumerate(got))
                assert client.objects.get(key)[2] is True  # layers read unchecked, as staged
        finally:
            monkeypatch.undo()
            client.close()


@pytest.mark.cluster
def test_objects_cross_through_the_arena_and_its_slots_come_back(kvconfig, shards):
    """Issue 32: the agent writes a request's objects into the vLLM side's shared-memory arena
    (bit-exact at ratio 1.0: every layer equals what was stored); the slots are free again
    once the objects are dropped, and when the agent is killed in the middle of a read (here:
    stopped, so its objects call is still open) its arena is retired and the next agent
    serves from a fresh one."""
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient

    client = agent_client(kvconfig, NAMESPACE, LocalCacheClient())
    pid = None
    try:
        assert client.transports[0].up and client.transports[0]._link.arena, "the agent mapped the arena"
        keys = [make_key(97800 + i) for i in range(4)]
        kvs = [shard_kv(40 + i, num_tokens=64) for i in range(4)]
        for k, kv in zip(keys, kvs, strict=True):
            client.put(k, kv)
        assert client.flush(30)
        assert all(m is not None for m in client.lookup(keys))
        for layer, fut in enumerate(client.fetch_layers(keys, range(kvs[0].shape[0]))):
            assert all(torch.equal(t, kv[layer]) for t, kv in zip(fut.result(30), kvs, strict=True))
        arena = client.transports[0].arenas.arena
        used = client.stats()["arena"]["arena_used_bytes"]
        assert used >= sum(kv.numel() * kv.element_size() for kv in kvs)  # the objects sit there
        client.drop_objects()
        assert arena.stats()["arena_used_bytes"] == 0

        pid = client.transports[0]._link.pid
        os.kill(pid, signal.SIGSTOP)  # the next objects call stays open
        reader = threading.Thread(target=lambda: client.fetch_layer(keys, 0).result(60))
        reader.start()
        deadline = time.monotonic() + 30
        while arena.stats()["arena_used_bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert arena.stats()["arena_used_bytes"] > 0  # reserved for the open call
        os.kill(pid, signal.SIGKILL)
        reader.join(60)
        deadline = time.monotonic() + 60
        while (client.transports[0].up or arena.stats()["arena_used_bytes"]) and time.monotonic() < deadline:
            time.sleep(0.05)  # the link ends (EOF): the open call fails, its slots come back
        assert arena.retired and arena.stats()["arena_used_bytes"] == 0
        while not client.transports[0].up and time.monotonic() < deadline:
            client.lookup(keys[:1])  # the next agent after the back-off
            time.sleep(0.2)
        assert client.transports[0].up and client.transports[0].arenas.arena is not arena
        got = client.fetch_layer(keys, 1).result(30)
        assert all(torch.equal(t, kv[1]) for t, kv in zip(got, kvs, strict=True))
    finally:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(pid, signal.SIGCONT)
        client.close()
