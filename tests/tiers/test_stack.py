"""TierStack: read-through with promotion, write-down with lz4 (raw or lz4 on top), prefetch,
per-layer futures, pins during reads, corrupt lower copies, concurrent writers/readers (no
torn objects), events, clear, and the tolerant opening of the shared tiers."""

from __future__ import annotations

import threading

import pytest

from tests.factories import NAMESPACE, as_layer, layer_buffers, make_key, make_kv, make_object
from tiers.format import CODEC_LZ4, parse_header
from tiers.host import HostTier
from tiers.stack import TierStack
from tiers.tier import MemoryTier

pytestmark = pytest.mark.cluster


@pytest.fixture
def stack3(make_tier):
    host, disk, redis = make_tier("host"), make_tier("disk"), make_tier("redis")
    stack = TierStack([host, disk, redis], write_down=("disk", "redis"), compression="lz4")
    yield stack, host, disk, redis
    stack.close()


def test_write_down_compresses_below_memory(stack3):
    stack, host, disk, redis = stack3
    key = make_key(1)
    kv = make_kv(compressible=True)
    obj = make_object(key, kv)                             # raw layers
    assert stack.put(key, obj)
    assert stack.flush(10)
    assert bytes(host.get(key)) == obj                     # memory keeps it raw
    for tier in (disk, redis):
        low = tier.get(key)
        assert {e.codec for e in parse_header(low).layers} == {CODEC_LZ4}
        assert len(low) < len(obj)
    assert stack.locate([key, make_key(2)]) == ["host", None]
    with pytest.raises(ValueError, match="not a valid chunk object"):
        stack.put(key, obj[:-1])


def test_read_through_promotes_and_is_bit_exact(stack3):
    stack, host, disk, redis = stack3
    key = make_key(1)
    kv = make_kv(compressible=True)
    obj = make_object(key, kv)
    redis.put(key, make_object(key, kv, compress=True))   # only in the bottom tier
    outs = layer_buffers(kv)
    header = stack.read_layers(key, range(3), outs)
    assert header is not None
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    assert stack.flush(10)
    assert bytes(host.get(key)) == obj                     # promoted, decompressed on top
    assert {e.codec for e in parse_header(disk.get(key)).layers} == {CODEC_LZ4}
    fut = stack.read_layer_async(key, 1)
    assert as_layer(fut.result(10), kv[1]).equal(kv[1])
    assert stack.stats()["stack"]["promotions"] == 1


def test_prefetch_and_async_layers_in_order(stack3):
    stack, host, disk, _redis = stack3
    keys = [make_key(i) for i in range(3)]
    kvs = [make_kv(seed=i) for i in range(3)]
    for k, kv in zip(keys, kvs, strict=False):
        disk.put(k, make_object(k, kv))
    assert [f.result(10) for f in stack.prefetch(keys + [make_key(9)])] == [True, True, True, False]
    assert host.contains(keys) == [True, True, True]
    futs = [stack.read_layer_async(k, layer) for layer in range(3) for k in keys]
    for n, f in enumerate(futs):
        layer, i = divmod(n, 3)
        assert as_layer(f.result(10), kvs[i][layer]).equal(kvs[i][layer])
    assert stack.read_layer_async(make_key(9), 0).result(10) is None


def test_corrupt_lower_copy_is_deleted_and_read_falls_through(stack3):
    stack, host, disk, redis = stack3
    key = make_key(1)
    kv = make_kv()
    bad = bytearray(make_object(key, kv))
    bad[-3] ^= 0xFF
    disk.put(key, bytes(bad))
    redis.put(key, make_object(key, kv))
    outs = layer_buffers(kv)
    assert stack.read_layers(key, range(3), outs) is not None
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    assert stack.flush(10)
    assert stack.stats()["stack"]["corrupt_deleted"] == 1
    assert bytes(disk.get(key)) == bytes(redis.get(key))    # the bad copy was replaced
    assert bytes(host.get(key)) == make_object(key, kv)
    assert stack.read_layers(make_key(5), [0], outs[:1]) is None
    assert stack.stats()["stack"]["misses"] == 1


def test_re_encoded_object_is_read_with_its_new_header_not_deleted(make_tier):
    """A header the stack cached goes stale when the object under the key is replaced by
    another encoding of the same KV (evicted, then written by a process that compresses
    differently): the read uses the object's new header; nothing is counted corrupt or deleted."""
    disk = make_tier("disk")
    stack = TierStack([disk])
    key = make_key(1)
    kv = make_kv(compressible=True)
    disk.put(key, make_object(key, kv, compress=True))
    outs = layer_buffers(kv)
    assert {e.codec for e in stack.read_layers(key, range(3), outs).layers} == {CODEC_LZ4}
    disk.delete([key])
    disk.put(key, make_object(key, kv))                    # raw this time: other offsets
    outs = layer_buffers(kv)
    header = stack.read_layers(key, range(3), outs)
    assert header is not None and {e.codec for e in header.layers} == {0}
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    assert stack.stats()["stack"]["corrupt_deleted"] == 0 and disk.contains([key]) == [True]
    stack.close()


def test_chunk_is_pinned_during_a_read(make_tier):
    host = HostTier(10_000)
    key = make_key(1)
    kv = make_kv()
    host.put(key, make_object(key, kv))
    seen = []

    stack = TierStack([host], write_down=())
    real = host.get_ranges_verified  # what tiers.reader reads layers of host memory with

    def spying(k, ranges):
        seen.append(host._index.is_pinned(k))
        return real(k, ranges)

    host.get_ranges_verified = spying
    assert stack.read_layers(key, [0], layer_buffers(kv)[:1]) is not None
    assert seen == [True] and not host._index.is_pinned(key)
    stack.close()


def test_concurrent_puts_and_reads_never_see_torn_objects(make_tier):
    host, disk = make_tier("host"), make_tier("disk", capacity_bytes=2_500)  # evicts under the readers
    stack = TierStack([host, disk], compression="lz4")
    keys = [make_key(i) for i in range(4)]
    kvs = [make_kv(seed=i, compressible=i % 2 == 0) for i in range(4)]
    objs = [make_object(k, kv) for k, kv in zip(keys, kvs, strict=False)]
    bad: list[str] = []
    stop = threading.Event()

    def writer(n):
        for r in range(30):
            i = (n + r) % 4
            stack.put(keys[i], objs[i])
            disk.put(keys[i], make_object(keys[i], kvs[i], compress=True))
            if r % 7 == 0:
                host.delete([keys[i]])

    def reader():
        while not stop.is_set():
            for i, k in enumerate(keys):
                outs = layer_buffers(kvs[i])
                if stack.read_layers(k, range(3), outs) is not None:
                    if not all(as_layer(o, kvs[i][j]).equal(kvs[i][j]) for j, o in enumerate(outs)):
                        bad.append(str(k))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads + readers:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert stack.flush(10)
    assert bad == []
    assert stack.stats()["stack"]["corrupt"] == 0
    assert stack.stats()["stack"]["hits"] > 0 and disk.stats()["evictions"] > 0
    stack.close()


def test_stack_arguments():
    with pytest.raises(ValueError):
        TierStack([])
    with pytest.raises(ValueError, match="write_down"):
        TierStack([HostTier(10)], write_down=("disk",))
    with pytest.raises(ValueError, match="unique"):
        TierStack([HostTier(10), HostTier(10)])


def test_stack_pins_span_a_request(make_tier):
    keys = [make_key(i) for i in range(3)]
    objs = [make_object(k, make_kv(seed=i)) for i, k in enumerate(keys)]
    host = HostTier(len(objs[0]) + len(objs[0]) // 2)      # room for one chunk
    stack = TierStack([host], write_down=())
    stack.put(keys[0], objs[0])
    assert stack.pin(keys[:1] + keys[2:]) == [True, False]
    stack.put(keys[1], objs[1])                    # would evict keys[0] if it were not pinned
    assert host.contains(keys[:2]) == [True, False]
    stack.unpin(keys[:1])
    stack.put(keys[1], objs[1])
    assert host.contains(keys[:2]) == [False, True]
    stack.close()


def test_stack_from_config(tmp_path, redis_url, s3_endpoint):
    from tiers.config import TiersConfig

    endpoint, bucket = s3_endpoint
    cfg = TiersConfig(host_size_gib=0.001, disk_size_gib=0.01, redis_url=redis_url,
                      s3_url=f"s3://{bucket}/cfg", s3_endpoint_url=endpoint, s3_region="us-east-1")
    stack = TierStack.from_config(cfg, str(tmp_path / "disk"))
    assert [t.name for t in stack.tiers] == ["host", "disk", "redis", "s3"]
    key = make_key(1)
    kv = make_kv()
    stack.put(key, make_object(key, kv))
    assert stack.flush(30)
    assert [t.contains([key])[0] for t in stack.tiers] == [True] * 4
    stack.tiers[0].delete([key])
    stack.tiers[1].delete([key])
    outs = layer_buffers(kv)
    assert stack.read_layers(key, range(3), outs) is not None
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    stack.close()
    assert TierStack.from_config(TiersConfig(disk_size_gib=0), "").tiers[0].name == "host"


def test_dead_redis_in_the_middle_of_a_stack_falls_through_to_s3(make_tier, private_redis):
    from tiers.redis_tier import RedisTier

    server = private_redis()
    host, redis, s3 = HostTier(1 << 20), RedisTier(server.url, timeout_s=0.5), make_tier("s3")
    stack = TierStack([host, redis, s3], compression="lz4")
    key = make_key(1)
    kv = make_kv()
    stack.put(key, make_object(key, kv))
    assert stack.flush(30)
    host.delete([key])
    server.kill()
    outs = layer_buffers(kv)
    assert stack.read_layers(key, range(3), outs) is not None     # served by S3
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    assert stack.flush(30) and host.contains([key]) == [True]     # promoted past dead Redis
    assert redis.stats()["errors"] >= 2                           # its read and its promotion put
    stack.close()


def _codecs(obj) -> set[int]:
    return {e.codec for e in parse_header(obj).layers}


def test_raw_top_false_keeps_the_top_tier_encoded_like_the_tiers_below():
    """The cache shard's stack starts at its disk: lz4 there too, on put and on promotion
    (copied as found), where the default (raw_top) stores raw objects on top."""
    key = make_key(1)
    kv = make_kv(compressible=True)
    obj = make_object(key, kv)
    disk, redis = MemoryTier(1 << 20, "disk"), MemoryTier(1 << 20, "redis")
    stack = TierStack([disk, redis], compression="lz4", raw_top=False)
    assert stack.put(key, obj) and stack.flush(10)
    assert _codecs(disk.get(key)) == _codecs(redis.get(key)) == {CODEC_LZ4}
    disk.delete([key])
    name, got, header = stack.find(key)
    assert name == "redis" and header.total_bytes == len(got) and stack.flush(10)
    assert bytes(disk.get(key)) == bytes(redis.get(key))     # promoted as found: lz4
    outs = layer_buffers(kv)
    assert stack.read_layers(key, range(3), outs) is not None
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
    stack.close()
    raw = TierStack([MemoryTier(1 << 20, "disk"), MemoryTier(1 << 20, "redis")])   # default
    raw.put(key, make_object(key, kv, compress=True))
    assert raw.flush(10) and _codecs(raw.tiers[0].get(key)) == {0}
    assert _codecs(raw.tiers[1].get(key)) == {CODEC_LZ4}
    raw.close()


def test_write_down_skips_tiers_holding_the_key_and_reports_events():
    """Every write, failed write and corrupt copy reaches on_event (the shard's metrics); a
    tier that already holds the key is not written again (first wins)."""
    events = []
    top, mid, full = MemoryTier(1 << 20, "disk"), MemoryTier(1 << 20, "redis"), MemoryTier(10, "s3")
    stack = TierStack([top, mid, full], raw_top=False,
                      on_event=lambda kind, tier, n: events.append((kind, tier, n > 0)))
    key, other = make_key(1), make_key(2)
    kv = make_kv(compressible=True)
    mid.put(key, make_object(key, kv, compress=True))
    puts = []
    real_put = mid.put
    mid.put = lambda k, o: puts.append(k) or real_put(k, o)
    assert stack.put(key, make_object(key, kv)) and stack.flush(10)
    assert puts == [] and sorted(events) == [("write", "disk", True), ("write_failed", "s3", True)]
    assert stack.stats()["stack"]["write_down_failures"] == 1
    events.clear()
    bad = bytearray(top.get(key))
    bad[-3] ^= 0xFF
    top.delete([key])
    top.put(key, bytes(bad))
    assert stack.find(key)[0] == "redis" and stack.flush(10)
    assert events == [("corrupt", "disk", False), ("write", "disk", True)]
    assert bytes(top.get(key)) == bytes(mid.get(key))              # the bad copy was replaced
    assert stack.store(other, make_object(other, make_kv(seed=2)), ["redis"]) == {"redis": True}
    assert top.contains([other]) == [False] and mid.contains([other]) == [True]
    with pytest.raises(ValueError, match="not all in this stack"):
        stack.store(other, make_object(other, kv), ["gpu"])

    def broken(k, o):
        raise OSError("disk gone")

    top.put = broken                                               # a raising tier: a failed write
    assert stack.put(make_key(3), make_object(make_key(3), kv)) is False
    assert stack.flush(10)
    stack.close()


def test_clear_deletes_a_namespace_from_listing_tiers(make_tier):
    host, disk = make_tier("host"), make_tier("disk")
    stack = TierStack([host, disk])
    mine, theirs = make_key(1), make_key(2, namespace="fedcba9876543210")
    for k in (mine, theirs):
        stack.put(k, make_object(k, make_kv()))
    assert stack.flush(10)
    assert stack.clear(NAMESPACE) == 2                             # host and disk copies
    assert stack.contains([mine, theirs]) == [False, True]
    assert stack.clear() == 2 and stack.contains([theirs]) == [False]
    stack.close()


def test_shared_tiers_leave_out_a_tier_that_cannot_be_opened(caplog, tmp_path):
    from tiers.config import TiersConfig
    from tiers.lower import shared_tiers

    cfg = TiersConfig(disk_size_gib=0, redis_url="http://not-redis", s3_url="gs://not-s3")
    assert shared_tiers(cfg) == []
    assert "redis tier http://not-redis unavailable" in caplog.text
    assert "s3 tier gs://not-s3 unavailable" in caplog.text
    assert [t.name for t in TierStack.from_config(cfg, str(tmp_path)).tiers] == ["host"]


class _BlockedTier(MemoryTier):
    """A lower tier whose puts wait until ``release`` is set (a slow disk under a burst)."""

    def __init__(self, name: str) -> None:
        super().__init__(1 << 30, name=name)
        self.release = threading.Event()

    def put(self, key, obj):
        assert self.release.wait(30)
        return super().put(key, obj)


def test_a_chunk_evicted_from_the_top_before_its_write_down_landed_is_still_read():
    """The top tier evicts a chunk whose write-down still waits: it is in no tier. The pending
    write holds it, so every read path finds it, bit-exact, and puts it back on top; a delete
    forgets it (a queued write-down of it never lands)."""
    kvs = [make_kv(i) for i in range(6)]
    keys = [make_key(i) for i in range(6)]
    objs = [make_object(k, kv) for k, kv in zip(keys, kvs, strict=True)]
    top, low = MemoryTier(2 * len(objs[0]) + 1, name="host"), _BlockedTier("disk")
    stack = TierStack([top, low], compression="none", max_workers=1)  # one write at a time
    try:
        for key, obj in zip(keys, objs, strict=True):
            assert stack.put(key, obj)
        assert top.contains(keys[:2]) == [False, False] and low.contains(keys[:2]) == [False, False]
        assert stack.locate([keys[0]]) == ["host"]                      # put back on top
        assert bytes(stack.get(keys[1])) == objs[1]
        outs = layer_buffers(kvs[2])
        assert stack.read_layers(keys[2], range(3), outs) is not None
        assert all(as_layer(o, kvs[2][i]).equal(kvs[2][i]) for i, o in enumerate(outs))
        assert stack.stats()["stack"]["write_behind_hits"] == 3
        assert stack.delete([keys[5]]) == 1                             # pending only: still counted
        low.release.set()
        assert stack.flush(30)
        assert low.contains(keys) == [True] * 5 + [False]               # the deleted one never landed
        assert stack.locate([keys[5]]) == [None]
    finally:
        low.release.set()
        stack.close()
