"""cluster.vllm.worker_source: the worker's gpu tier in front of the cache client."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import Future

import pytest
import torch

from blend.protocols import KVSource, fetch_each
from cluster.cache.local import LocalCacheClient
from cluster.cache.ops import DeferredRead
from cluster.vllm.worker_source import WorkerKVSource, build_worker_source
from tiers.gpu import GpuTier
from tiers.keys import ChunkKey

pytestmark = pytest.mark.unit

L, T, H, D = 3, 5, 2, 4


class _Client:
    def __init__(self, chunks):
        self.chunks = chunks
        self.reads: list[tuple[tuple[ChunkKey, ...], int]] = []

    def lookup(self, keys):
        return [None for _ in keys]

    def fetch_layers(self, keys, layer_idxs):
        return fetch_each(self.fetch_layer, keys, layer_idxs)

    def fetch_layer(self, keys, layer_idx):
        self.reads.append((tuple(keys), layer_idx))
        f: Future = Future()
        f.set_result([self.chunks[k][layer_idx] if k in self.chunks else None for k in keys])
        return f


def _key(i: int) -> ChunkKey:
    return ChunkKey("ns", "seg", f"{i:032x}")


def test_gpu_tier_chunks_are_served_there_and_the_rest_through_the_client():
    """Chunks the worker computed (``remember``) come from the gpu tier, bit for bit, with no
    client read; the others through the client; a chunk read through the client is not put
    into the gpu tier (a blend never reads a whole chunk: its layers start at the check layer)."""
    chunks = {_key(i): torch.randn(L, 2, T, H, D) for i in range(2)}
    client = _Client(chunks)
    src = WorkerKVSource(client, GpuTier(1 << 20), num_layers=L)
    src.remember(_key(0), chunks[_key(0)])
    keys = [_key(0), _key(1), _key(9)]  # in the gpu tier, at the client, cached nowhere
    got = [f.result(timeout=30) for f in src.fetch_layers(keys, range(1, L))]
    assert client.reads == [((_key(1), _key(9)), layer) for layer in range(1, L)]
    for layer, row in zip(range(1, L), got, strict=True):
        assert torch.equal(row[0], chunks[_key(0)][layer]) and torch.equal(row[1], chunks[_key(1)][layer])
        assert row[2] is None
    assert src.gpu_hits(keys) == 1
    client.reads.clear()
    again = [f.result(timeout=30) for f in src.fetch_layers([_key(0)], range(L))]
    assert client.reads == [] and all(torch.equal(a[0], chunks[_key(0)][i]) for i, a in enumerate(again))


def test_a_failing_or_cancelled_read_is_a_miss_never_a_hang():
    class Broken(_Client):
        def fetch_layer(self, keys, layer_idx):
            f: Future = Future()
            f.set_exception(RuntimeError("shard died"))
            return f

    src = WorkerKVSource(Broken({}), None, num_layers=L)
    assert [f.result(timeout=5) for f in src.fetch_layers([_key(0)], range(L))] == [[None]] * L
    pending: Future = Future()

    class Stuck(_Client):
        def fetch_layers(self, keys, layer_idxs):
            return [pending for _ in layer_idxs]

    out = WorkerKVSource(Stuck({}), None, num_layers=L).fetch_layers([_key(0)], [1])[0]
    assert out.cancel() and pending.cancelled()  # cancelling the merged future cancels the read


def test_no_gpu_tier_reads_every_layer_from_the_client():
    chunks = {_key(0): torch.randn(L, 2, T, H, D)}
    client = _Client(chunks)
    src = WorkerKVSource(client, None, num_layers=L)
    for _ in range(2):
        for layer in range(L):
            assert torch.equal(src.fetch_layer([_key(0)], layer).result()[0], chunks[_key(0)][layer])
    assert len(client.reads) == 2 * L and src.gpu_hits([_key(0)]) == 0
    src.remember(_key(0), chunks[_key(0)])  # no gpu tier: nothing kept, no error
    assert src.gpu_hits([_key(0)]) == 0


def test_built_source_on_cpu_reads_the_client_directly():
    """build_worker_source (the worker's and bench gpu's one builder): on the CPU it reads the
    client directly (no staging), every layer of a request from one fetch_layers call, bit
    for bit."""
    client = LocalCacheClient()
    chunks = {_key(i): torch.randn(L, 2, T, H, D) for i in range(2)}
    for k, kv in chunks.items():
        client.put(k, kv)
    src = build_worker_source(client, "cpu", L, gpu_bytes=1 << 20)
    assert isinstance(src, KVSource) and src.reader is client
    keys = [_key(0), _key(1), _key(9)]
    futs = src.fetch_layers(keys, range(L))
    for layer, fut in enumerate(futs):
        got = fut.result(timeout=30)
        assert torch.equal(got[0], chunks[_key(0)][layer]) and torch.equal(got[1], chunks[_key(1)][layer])
        assert got[2] is None
    assert src.gpu_hits(keys) == 0  # reads are not put into the gpu tier
    assert build_worker_source(client, "cpu", L).gpu is None  # gpu_bytes 0: no gpu tier


def test_read_layers_are_freed_when_dropped_without_the_cyclic_collector():
    """Issue 20 soak: each merged future and its reader's future referred to each other (the
    reader's done callback held the merged one), so every layer a blend read — and the gpu-tier
    chunks beside it — stayed in memory until Python's full collection ran (the worker's heap
    grew 3.4 -> 6.5 GiB in 20 minutes, then fell at once). With the collector off, what a
    consumer drops must be freed by reference counting alone; also a future never asked for."""
    class _DeferredClient(_Client):  # pending until asked, as the machine-local and agent clients
        def fetch_layers(self, keys, layer_idxs):
            return [DeferredRead(lambda i=i: self.fetch_layer(keys, i).result()) for i in layer_idxs]

    chunks = {_key(i): torch.randn(L, 2, T, H, D) for i in range(2)}
    src = WorkerKVSource(_DeferredClient(chunks), GpuTier(1 << 20), num_layers=L)
    src.remember(_key(0), chunks[_key(0)].clone())
    gc.collect()
    gc.disable()
    try:
        futs = src.fetch_layers([_key(0), _key(1)], range(L))
        got = futs[0].result(timeout=30)
        merged, future, unasked = weakref.ref(got), weakref.ref(futs[0]), weakref.ref(futs[1])
        assert torch.equal(got[1], chunks[_key(1)][0])
        del futs, got
        assert merged() is None and future() is None and unasked() is None
    finally:
        gc.enable()


def test_a_request_fits_an_agents_arena_in_prompt_order_and_gpu_tier_chunks_always_fit():
    """Over a cache agent a request's objects sit in its arena together: the chunks beyond
    ARENA_SHARE of it do not fit (the engine computes them); gpu-tier chunks take no arena room;
    a client without an arena fits everything."""
    from cluster.vllm.worker_source import ARENA_SHARE

    class _AgentClient(_Client):
        def arena_stats(self):
            return {"arena_bytes": 1000, "arena_used_bytes": 900, "arena_peak_bytes": 900}

    chunk = torch.randn(L, 2, T, H, D)
    src = WorkerKVSource(_AgentClient({}), GpuTier(1 << 20), num_layers=L)
    src.remember(_key(2), chunk)
    keys = [_key(i) for i in range(5)]
    room = int(1000 * ARENA_SHARE)
    sizes = [room // 2, room // 2, 10_000, 1, room]  # the third is in the gpu tier
    assert src.fit_request(keys, sizes) == [True, True, True, False, False]
    assert src.fit_request(keys[:1], [room + 1]) == [False]
    assert WorkerKVSource(_Client({}), None, num_layers=L).fit_request(keys, sizes) == [True] * 5
