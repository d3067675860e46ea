"""CUDA: a request's chunk objects that arrived in the cache agent's arena go to the GPU from
there (the arena is registered with CUDA: no staging fill), bit-exact, and their slots come back
once the copies that read them completed (issue 32). The real client over the agent chain, its
:class:`ClientHostLayers` and the worker's :func:`build_worker_source`; the agent is a stand-in
link that writes objects into the arena through an :class:`ArenaWriter`, as the agent does.

Needs a GPU (skipped otherwise by the gpu marker)."""

from __future__ import annotations

import os
from concurrent.futures import Future

import pytest
import torch

from cluster.cache.arena import ArenaWriter
from tests.factories import NAMESPACE, make_key, make_object, shard_kv

pytestmark = [pytest.mark.gpu, pytest.mark.unit]
CUDA = torch.device("cuda")


class _ArenaLink:
    """Answers lookup and objects like the agent, writing objects into the client's arena."""

    pid = 1
    arena = True
    closed = False

    def __init__(self, client, objects: dict) -> None:
        self.objects = objects
        arena = client.transports[0].arenas.arena
        self.writer = ArenaWriter(os.dup(arena.fd), arena.nbytes)

    def call(self, message, buffers=()):
        from cluster.cache.ops import LookupAnswer, LookupHit, SlotsAnswer

        fut = Future()
        if message["op"] == "lookup":
            hits = tuple(LookupHit("host", self.objects[k], "shard-0") for k in message["keys"])
            fut.set_result(LookupAnswer(hits).to_wire())
        else:  # as the agent does: headers now, the rest in rounds told by the progress word
            items = [(off, cap, self.objects[k]) for k, (off, cap) in zip(message["keys"], message["slots"],
                                                                           strict=True)]
            progress = message.get("progress", -1)
            sizes = tuple(self.writer.write_progressively(items, progress) if progress >= 0
                          else self.writer.write_many(items))
            fut.set_result(SlotsAnswer(("host",) * len(sizes), sizes).to_wire())
        return fut

    def close(self) -> None:
        self.closed = True


def test_arena_objects_reach_the_gpu_unstaged_bit_exact_and_their_slots_come_back(monkeypatch):
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config
    from cluster.vllm.worker_source import build_worker_source

    cfg = load_config(environ={}, overrides={"ray_address": "127.0.0.1:1"})
    client = agent_client(cfg, NAMESPACE, LocalCacheClient())
    try:
        arena = client.transports[0].arenas.new_arena(64 << 20)
        keys = [make_key(99000 + i) for i in range(3)]
        kvs = [shard_kv(60 + i, num_tokens=256) for i in range(3)]
        link = _ArenaLink(client, {str(k): make_object(k, kv) for k, kv in zip(keys, kvs, strict=True)})
        monkeypatch.setattr(client.transports[0], "_link", link)
        source = build_worker_source(client, CUDA, kvs[0].shape[0], pinned_bytes=0)
        assert arena.registered, "a CUDA staging source registers the agent's arena"
        assert all(m is not None for m in source.lookup(keys))
        for layer, fut in enumerate(source.fetch_layers(keys, range(kvs[0].shape[0]))):
            batch = fut.result(60)
            torch.cuda.current_stream().wait_event(batch.ready)
            for t, kv in zip(batch, kvs, strict=True):
                assert t.device.type == "cuda" and torch.equal(t.cpu(), kv[layer])
        stats = source.reader.transfer_stats()
        assert stats.num_copies > 0 and stats.fill_bytes == 0  # straight from the arena
        source.reader.layers.forget()
        client.drop_objects()
        assert arena.stats()["arena_used_bytes"] == 0  # the copies completed: every slot back
        source.close()
    finally:
        monkeypatch.undo()
        client.close()
