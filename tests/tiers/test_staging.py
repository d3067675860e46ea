"""StagedSource (tiers.staging) on the CPU: bit-exact round trips from every byte tier, corrupt
or missing chunks and layers as misses, an object re-encoded between requests, lz4 layers
decoded, every layer of a request from one ``fetch_layers`` call. The staged pipeline under
the blend engine, on CUDA: ``tests/blend/test_ops_cuda.py``."""

from __future__ import annotations

import pytest
import torch

from tests.factories import NAMESPACE, make_object
from tiers.disk import DiskTier
from tiers.host import HostTier
from tiers.host_layers import TierLayers
from tiers.keys import segment_key
from tiers.staging import StagedSource
from tiers.tier import MemoryTier

pytestmark = pytest.mark.unit


def _objects(num_chunks=3, num_layers=3, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(9)
    out = {}
    for i in range(num_chunks):
        key = segment_key(NAMESPACE, [i, 100 + i])
        out[key] = torch.randn(num_layers, 2, 5 + i, 2, 8, generator=g).to(dtype)
    return out


def _host_with(chunks) -> HostTier:
    """A host tier holding each chunk's encoded object."""
    host = HostTier(1 << 26)
    for key, kv in chunks.items():
        host.put(key, make_object(key, kv))
    return host


def test_staged_source_round_trips_every_tier_bit_exact(tmp_path):
    chunks = _objects()
    host, disk, mem = HostTier(1 << 26), DiskTier(str(tmp_path), 1 << 26, fsync=False), MemoryTier(1 << 26)
    for key, kv in chunks.items():
        obj = make_object(key, kv)
        host.put(key, obj), disk.put(key, obj), mem.put(key, obj)
    keys = list(chunks)
    for tier in (host, disk, mem):
        src = StagedSource(tier, "cpu", read_ahead=1)
        metas = src.lookup(keys)
        assert [m.num_tokens for m in metas] == [5, 6, 7] and metas[0].positions == tuple(range(5))
        assert metas[0].tier == tier.name
        for layer in range(3):
            got = src.fetch_layer(keys, layer).result()
            assert all(torch.equal(x, chunks[key][layer]) for x, key in zip(got, keys, strict=False)), tier.name
        # one call for every layer (what the blend engine makes), in the order asked
        futs = src.fetch_layers(keys, [2, 0, 1])
        for layer, fut in zip([2, 0, 1], futs, strict=True):
            got = fut.result(timeout=30)
            assert all(torch.equal(x, chunks[key][layer]) for x, key in zip(got, keys, strict=False)), tier.name
        src.close()


def test_staged_source_corrupt_or_missing_is_none(tmp_path):
    chunks = _objects()
    host = HostTier(1 << 26)
    keys = list(chunks)
    for i, (key, kv) in enumerate(chunks.items()):
        obj = bytearray(make_object(key, kv))
        if i == 1:
            obj[-3] ^= 0xFF  # flip a byte in the last layer's payload
        host.put(key, bytes(obj))
    missing = segment_key(NAMESPACE, [999])
    src = StagedSource(TierLayers(host), "cpu")
    assert src.lookup(keys + [missing])[-1] is None
    got = src.fetch_layer(keys + [missing], 2).result()
    assert got[1] is None and got[3] is None
    assert torch.equal(got[0], chunks[keys[0]][2]) and torch.equal(got[2], chunks[keys[2]][2])
    assert src.fetch_layer(keys, 0).result()[1] is not None  # only the flipped layer is bad
    assert src.fetch_layer(keys, 7).result() == [None, None, None]  # past the layers
    assert src.read_counters.snapshot()["corrupt"] >= 1
    src.close()


def test_staged_source_reads_an_object_re_encoded_between_requests(tmp_path):
    """The object under a key is re-encoded (raw -> lz4: other offsets and checksums) between
    two requests: headers are read once per request, so the next request is bit-exact."""
    g = torch.Generator().manual_seed(3)
    key = segment_key(NAMESPACE, [7, 8])
    kv = torch.randint(-2, 3, (3, 2, 64, 2, 8), generator=g).to(torch.bfloat16)  # lz4 shrinks it
    disk = DiskTier(str(tmp_path), 1 << 26, fsync=False)
    disk.put(key, make_object(key, kv))
    src = StagedSource(disk, "cpu", read_ahead=0)
    assert src.lookup([key])[0] is not None
    assert torch.equal(src.fetch_layer([key], 0).result()[0], kv[0])
    disk.delete([key])
    disk.put(key, make_object(key, kv, compress=True))
    for layer, fut in zip((2, 0, 1), src.fetch_layers([key], [2, 0, 1]), strict=True):
        assert torch.equal(fut.result(timeout=30)[0], kv[layer]), layer
    assert src.read_counters.snapshot()["corrupt"] == 0
    src.close()


def test_staged_source_decodes_lz4_layers(tmp_path):
    from tiers.format import encode_chunk

    key = segment_key(NAMESPACE, [7, 7, 7])
    kv = torch.ones(2, 2, 64, 2, 8, dtype=torch.bfloat16)  # compressible: stored as lz4
    kv[1] *= 3
    raw = kv.view(torch.uint8).view(2, -1).numpy()
    obj = encode_chunk(key, [raw[0], raw[1]], dtype="bfloat16", num_tokens=64, num_kv_heads=2,
                       head_dim=8, compress=True)
    assert len(obj) < kv.numel() * 2
    for tier in (HostTier(1 << 24), DiskTier(str(tmp_path), 1 << 24, fsync=False)):
        tier.put(key, obj)
        src = StagedSource(tier, "cpu")
        assert src.lookup([key])[0].num_tokens == 64
        for layer in range(2):
            assert torch.equal(src.fetch_layer([key], layer).result()[0], kv[layer])
        assert src.read_counters.snapshot() == {"hits": 2, "misses": 0, "corrupt": 0, "oversized": 0}
        src.close()


def test_staging_stays_a_bounded_number_of_layers_ahead_of_the_consumer(tmp_path):
    """Every queue has a bound: with ``max_ahead=2`` the staging thread delivers at most two
    layers beyond the last one taken; cancelling the rest releases it at once (no wait for
    the take timeout); a consumer that stops asking gets misses after ``take_timeout_s``."""
    import time

    chunks = _objects(num_layers=6)
    host = _host_with(chunks)
    keys = list(chunks)
    src = StagedSource(host, "cpu", max_ahead=2, take_timeout_s=1.0)
    futs = src.fetch_layers(keys, range(6))
    time.sleep(0.3)
    assert [f.done() for f in futs] == [True, True, False, False, False, False]
    assert torch.equal(futs[0].result(timeout=5)[0], chunks[keys[0]][0])
    futs[1].result(timeout=5)  # layers 0 and 1 taken: 2 and 3 may be delivered
    assert torch.equal(futs[3].result(timeout=5)[1], chunks[keys[1]][3])
    assert futs[2].done() and not futs[4].done()
    t0 = time.monotonic()
    for f in futs[4:]:
        f.cancel()
    again = src.fetch_layers(keys, [5])  # the next request is not stuck behind the last one
    assert torch.equal(again[0].result(timeout=5)[2], chunks[keys[2]][5])
    assert time.monotonic() - t0 < 1.0
    stalled = src.fetch_layers(keys, range(4))  # nobody takes layer 0: 2 and 3 become misses
    assert stalled[3].result(timeout=10) == [None] * 3
    src.close()


def test_a_chunk_used_again_is_read_from_pinned_memory_bit_exact():
    """tiers.pinned: a chunk's first use stages through the slots; from its second use it is
    queued for pinning; once pinned, requests copy straight from pinned memory (no fill),
    bit for bit; an LRU too small for every chunk keeps what fits and evicts the rest."""
    chunks = _objects(num_layers=4)
    host = _host_with(chunks)
    keys = list(chunks)
    src = StagedSource(host, "cpu")
    first = [f.result(timeout=30) for f in src.fetch_layers(keys, range(4))]
    assert src.pinned.wait_idle(30) and src.pinned.stats()["num_chunks"] == 0  # seen once: not yet
    [f.result(timeout=30) for f in src.fetch_layers(keys, range(4))]
    assert src.pinned.wait_idle(30) and src.pinned.stats()["num_chunks"] == 3
    before = src.transfer_stats().fill_bytes
    second = [f.result(timeout=30) for f in src.fetch_layers(keys, range(4))]
    assert src.transfer_stats().fill_bytes == before  # no slot was filled: read from pinned memory
    for layer in range(4):
        for key, a, b in zip(keys, first[layer], second[layer], strict=True):
            assert torch.equal(a, chunks[key][layer]) and torch.equal(b, chunks[key][layer])
    src.close()
    one = max(kv.numel() * kv.element_size() for kv in chunks.values())  # the largest chunk
    small = StagedSource(host, "cpu", pinned_bytes=one + 1)
    for _ in range(2):
        [f.result(timeout=30) for f in small.fetch_layers(keys, range(4))]
    assert small.pinned.wait_idle(30)
    stats = small.pinned.stats()
    assert stats["num_chunks"] == 1 and stats["evicted"] == 2 and stats["bytes_used"] <= one + 1
    small.close()


def test_a_reader_that_fails_resolves_every_layer_as_a_miss():
    class Broken:
        name = "broken"

        def headers(self, keys):
            raise RuntimeError("shard died")

        def layer_into(self, key, header, layer_idx, out):
            raise AssertionError("not reached")

    src = StagedSource(Broken(), "cpu")
    keys = list(_objects())
    assert [f.result(timeout=10) for f in src.fetch_layers(keys, range(3))] == [[None] * 3] * 3
    src.close()


def test_a_paused_consumer_does_not_hold_up_the_next_request():
    """An async blend takes its layers across engine steps: while it pauses, a newer request
    on the same source is staged at once, not after the take timeout."""
    import time

    chunks = _objects(num_layers=6)
    host = _host_with(chunks)
    keys = list(chunks)
    src = StagedSource(host, "cpu", max_ahead=1, take_timeout_s=20.0)
    paused = src.fetch_layers(keys, range(6))
    paused[0].result(timeout=5)  # takes one layer, then pauses
    t0 = time.monotonic()
    newer = src.fetch_layers(keys, [4])[0].result(timeout=10)
    assert time.monotonic() - t0 < 5.0 and torch.equal(newer[0], chunks[keys[0]][4])
    for layer, fut in enumerate(paused):  # the paused request still gets every layer, exact
        assert torch.equal(fut.result(timeout=10)[1], chunks[keys[1]][layer])
    src.close()


def test_a_normal_request_logs_nothing_critical(caplog):
    """Every future is resolved once: finishing a request never touches a future twice
    (concurrent.futures logs CRITICAL and raises for a finished one)."""
    import logging

    chunks = _objects()
    host = _host_with(chunks)
    src = StagedSource(host, "cpu")
    with caplog.at_level(logging.WARNING):
        [f.result(timeout=10) for f in src.fetch_layers(list(chunks), range(3))]
        src.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_close_resolves_requests_that_never_started():
    """close() while a request waits behind a stuck one: the waiting one resolves as misses at
    once (shutdown would otherwise drop it unresolved), the stuck one when it ends."""
    import threading

    release = threading.Event()

    class Stuck:
        name = "stuck"

        def headers(self, keys):
            release.wait(30)
            return [None] * len(keys)

        def layer_into(self, key, header, layer_idx, out):
            raise AssertionError("not reached")

    keys = list(_objects())
    src = StagedSource(Stuck(), "cpu")
    first = src.fetch_layers(keys, range(2))
    second = src.fetch_layers(keys, range(2))
    closer = threading.Thread(target=src.close)
    closer.start()
    assert [f.result(timeout=10) for f in second] == [[None] * 3] * 2
    release.set()
    closer.join(30)
    assert not closer.is_alive() and [f.result(timeout=10) for f in first] == [[None] * 3] * 2


class _PacedReads:
    """A tier whose every read (``get``, ``get_ranges``) costs ``seconds`` on ``clock`` (no real
    sleep), its faster read paths hidden: a remote store as the staging source reads it."""

    FAST = frozenset({"open_stream", "get_ranges_into", "get_ranges_into_each", "get_ranges_verified"})

    def __init__(self, tier, clock: list[float], seconds: float) -> None:
        self.tier, self.clock, self.seconds, self.name, self.reads = tier, clock, seconds, "paced", 0

    def get(self, key):
        self.reads += 1
        self.clock[0] += self.seconds
        return self.tier.get(key)

    def get_ranges(self, key, ranges):
        self.reads += 1
        self.clock[0] += self.seconds
        return self.tier.get_ranges(key, ranges)

    def __getattr__(self, name):
        if name in self.FAST:
            raise AttributeError(name)
        return getattr(self.tier, name)


def test_each_layer_carries_the_sources_busy_time_without_its_waits_for_the_consumer(monkeypatch):
    """``busy_s`` (issue 34's point sample): the reads a request made, on the source's clock,
    growing layer by layer; the staging thread's waits for a consumer that takes its layers
    late are not in it. The clock here moves only when the tier reads and while the consumer
    holds the staging thread back (``max_ahead=1``: it waits for each layer's take), so the
    last layer's ``busy_s`` is exactly the reads' time however long the consumer took."""
    import time
    import types

    from tiers import staging

    clock = [0.0]
    monkeypatch.setattr(staging, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    chunks = _objects(num_layers=4)
    keys = list(chunks)
    paced = _PacedReads(_host_with(chunks), clock, 0.25)
    src = StagedSource(paced, "cpu", max_ahead=1, take_timeout_s=30.0)
    futs = src.fetch_layers(keys, range(4))
    busy = []
    for layer, fut in enumerate(futs):
        deadline = time.monotonic() + 30
        while not fut.done() and time.monotonic() < deadline:  # delivered, not taken: the
            time.sleep(0.01)                                   # staging thread waits for us
        clock[0] += 100.0  # the consumer's own time (its compute before it takes the layer)
        got = fut.result(timeout=30)
        assert all(torch.equal(x, chunks[k][layer]) for x, k in zip(got, keys, strict=True))
        busy.append(got.busy_s)
    assert paced.reads >= 4 * len(keys)  # every chunk's every layer was read from the tier
    assert busy == sorted(busy) and busy[0] > 0
    assert busy[-1] == pytest.approx(0.25 * paced.reads)
    src.close()
