"""AgentClient over a real cache agent process on the session Ray cluster: round trips equal
to the Ray client's bytes, a lost agent serves the fallback and a new one takes over, the
wire's limits, and a cluster that never answers."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from tests.factories import NAMESPACE, make_key, returns_within, shard_kv


@pytest.mark.cluster
def test_agent_round_trip_then_lost_agent_falls_back_and_reconnects(kvconfig, shards):
    from cluster.cache.agent_client import AgentClient
    from cluster.cache.local import LocalCacheClient

    fallback = LocalCacheClient()
    client = AgentClient(kvconfig, NAMESPACE, fallback)
    try:
        assert client.up, "the first agent starts within the constructor"
        pid = client._link.pid
        assert pid != os.getpid()
        keys = [make_key(97300 + i) for i in range(5)]
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
        while client.up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.up
        assert client.lookup(keys) == [None] * 5
        assert [f.result(5) for f in client.fetch_layers(keys, [0])] == [[None] * 5]
        assert client.counters["agent_exits"] == 1 and client.counters["agent_down_calls"] >= 2
        while not client.up and time.monotonic() < deadline:
            client.lookup(keys[:1])  # calls start the next agent after the back-off
            time.sleep(0.2)
        assert client.up and client._link.pid != pid
        assert all(m is not None for m in client.lookup(keys)), "hits resume with the new agent"
        assert client.counters["agent_starts"] == 2
    finally:
        client.close()


@pytest.mark.unit
def test_no_ray_means_fallback_without_an_agent():
    """Nothing listens at ray_address: no agent process, the fallback serves, nothing raises."""
    from cluster.cache.agent_client import AgentClient
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from cluster.workloads.services import free_port

    cfg = load_config(environ={}, overrides={"ray_address": f"127.0.0.1:{free_port()}"})
    fallback = LocalCacheClient()
    client = returns_within(AgentClient, cfg, NAMESPACE, fallback, what="an unreachable Ray")
    try:
        assert not client.up
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

    from cluster.cache.agent_client import AgentClient
    from cluster.cache.lifecycle import start_shards, stop_shards
    from cluster.cache.local import LocalCacheClient

    cluster_cfg = dataclasses.replace(kvconfig.cluster, ray_namespace=f"kvblend-late-{uuid.uuid4().hex[:6]}")
    cfg = dataclasses.replace(kvconfig, cluster=cluster_cfg)
    client = AgentClient(cfg, NAMESPACE, LocalCacheClient())
    try:
        assert not client.up  # the agent said "no shards" and exited
        started = start_shards(cfg)
        key, kv = make_key(97401), shard_kv(3, num_tokens=5)
        deadline = time.monotonic() + 120
        while not client.up and time.monotonic() < deadline:
            client.lookup([key])
            time.sleep(0.25)
        assert client.up and client.counters["agent_starts"] == 1
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
