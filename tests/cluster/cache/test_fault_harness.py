"""The fault-injection harness (issue #20): a cache shard over real services under real faults.

``CacheShard`` is built in-process (:func:`tests.factories.ray_free_shard`, no Ray) over a real
redis-server, moto's S3 server and a disk directory, with the faults of
:mod:`cluster.workloads.faults` between them: a TCP black hole and a slow proxy in front of
Redis and S3, SIGSTOP of redis-server, a full disk (a small tmpfs), corrupted, truncated and
oversized objects put straight into each tier, and objects deleted while the shard's index
still lists them. Each test checks that (a) every call returns (a hang guard of
:data:`HANG_S`, the only timing), (b) the faulted keys are misses, never an exception nor
wrong bytes, (c) the deadline, breaker or error counters moved, and (d) once the fault is
lifted, reads hit again with the bytes that were put, bit-exact (``torch.equal``).

The shard's ``ray.put`` stand-in keeps each host object's bytes (``shard.objects``), so that
``get_refs`` — promotion from the faulted tier included — can be checked byte for byte. Apart
from the hang guard, the one wait is the proxy self-test's 0.5 s for nothing to come back
through the black hole (it cannot pass wrongly: a forwarded reply comes within milliseconds).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from cluster.workloads.faults import (
    BLACKHOLE,
    CORRUPTIONS,
    PASS,
    SLOW,
    TcpProxy,
    TmpfsUnavailable,
    corrupt_object,
    remove_object,
    sigstopped,
    small_tmpfs,
)
from tests.factories import (
    make_key,
    make_kv,
    make_object,
    ray_free_shard,
    returns_within,
    stop_shard,
)
from tiers.codec import layer_tensor
from tiers.config import TiersConfig
from tiers.format import decode_layer, parse_header

pytestmark = pytest.mark.cluster

#: seconds any one call may take before it counts as a hang (a guard, never a timing assertion)
HANG_S = 90.0
#: the shards' lookup deadline: 4x the default, so that on a loaded 2-core machine every read
#: starts before it (a key whose read never started is late without blaming the tier, and the
#: breaker would not open: seen with 0.25 s while vLLM tests ran beside)
LOOKUP_TIMEOUT_S = 4 * TiersConfig.lookup_timeout_s
#: the slow-proxy test's deadline, and its delay each way (more than the deadline; a round trip
#: stays under the default io_timeout_s)
SLOW_LOOKUP_TIMEOUT_S = 2 * TiersConfig.lookup_timeout_s
SLOW_DELAY_S = 1.2 * SLOW_LOOKUP_TIMEOUT_S
#: per tier call: twice the lookup deadline, so a read a fault blocks is still out when the
#: deadline comes (a late key, counted as a timeout, not a failed read) and gives up soon after
#: (the slow test uses the default)
IO_TIMEOUT_S = 2 * LOOKUP_TIMEOUT_S
#: the lookup deadline of the tests whose subject it is not (bad objects, full disk): a loaded
#: machine (moto's S3 server runs in this process) never makes their lookups late
NO_DEADLINE_S = 60.0
#: a get_refs deadline while a fault blocks the tier (its default; after a fault reads may wait)
FAULT_READ_S = 5.0


def _shard(monkeypatch, disk_root, **cfg):
    """A Ray-free shard whose host objects are kept in ``shard.objects``; the breaker's
    cool-down is an hour (a test ends it by hand: no sleeps)."""
    cfg = {"host_size_gib": 0.01, "disk_size_gib": 0.0, "io_timeout_s": IO_TIMEOUT_S,
           "lookup_timeout_s": LOOKUP_TIMEOUT_S, **cfg}
    s = ray_free_shard(monkeypatch, disk_root, TiersConfig(**cfg))
    s.objects = {}  # ref -> the object's bytes (the shard's ray.put stand-in)

    def store_host(key, obj, header_end):
        data = bytes(memoryview(obj).cast("B"))
        ref = f"ref:{key}"
        if not s.host.put_object(key, (ref, data[:header_end], len(data)), len(data)):
            return None
        s.objects[ref] = data
        return ref

    s._store_host = store_host
    s._lower_lookup.cooldown_s = 3600.0
    return s


@pytest.fixture
def shards(monkeypatch):
    """``make(disk_root, **TiersConfig fields)`` -> a shard, all stopped after the test (their
    pools, lookup threads, tier stack and shared tiers)."""
    made = []

    def make(disk_root, **cfg):
        made.append(_shard(monkeypatch, disk_root, **cfg))
        return made[-1]

    yield make
    for s in made:
        stop_shard(s)
        if s.lower_stack is not None:
            s.lower_stack.close(timeout_s=30)
        for tier in s.shared:
            tier.close()


@pytest.fixture
def proxies():
    """``start(host, port)`` -> a running :class:`TcpProxy`; every one is closed after the
    test, and none may leave a thread behind."""
    started: list[TcpProxy] = []
    with contextlib.ExitStack() as stack:

        def start(host, port):
            started.append(stack.enter_context(TcpProxy(host, port)))
            return started[-1]

        yield start
    assert all(p.threads_alive() == 0 for p in started), "a proxy thread outlived close()"


def _chunks(n, seed=0, **kw):
    """``n`` keys under a namespace of this test's own (shared services keep other tests'
    chunks) and their KV ``[L, 2, T, H, D]``."""
    namespace = uuid.uuid4().hex[:16]
    keys = [make_key(seed + i, namespace=namespace) for i in range(n)]
    return keys, [make_kv(seed + i, **kw) for i in range(n)]


def _put(shard, keys, kvs):
    """Put each chunk (host now, lower tiers in background) and wait for the write-downs."""
    for k, kv in zip(keys, kvs, strict=True):
        assert shard.put(str(k), np.frombuffer(make_object(k, kv), np.uint8))
    assert returns_within(shard.drain, hang_s=HANG_S)


def _below_host(shard, keys, kvs):
    """Put the chunks and drop them from host memory: reads must come from the lower tiers."""
    _put(shard, keys, kvs)
    shard.host.delete(keys)


def _lookup(shard, keys):
    """``shard.lookup`` (no prefetch) of ``keys``: per key its tier name or None."""
    got = returns_within(lambda: shard.lookup([str(k) for k in keys], prefetch=False),
                         hang_s=HANG_S, what="lookup blocked")
    return [None if g is None else g[0] for g in got]


def _read(shard, keys, timeout_s=HANG_S):
    """``shard.get_refs`` of ``keys`` (its deadline ``timeout_s``) decoded: per key KV
    ``[L, 2, T, H, D]`` or None."""
    refs = returns_within(lambda: shard.get_refs([str(k) for k in keys], timeout_s),
                          hang_s=HANG_S + timeout_s, what="get_refs blocked")
    out = []
    for key, ref in zip(keys, refs, strict=True):
        if ref is None:
            out.append(None)
            continue
        obj = shard.objects[ref[0]]
        header = parse_header(obj, expected_key=key)
        layers = [layer_tensor(decode_layer(header, i, obj[e.offset:e.offset + e.stored_len]),
                               header.layer_shape, header.dtype)
                  for i, e in enumerate(header.layers)]
        out.append(torch.stack(layers))  # [L, 2, T, H, D]
    return out


def _assert_exact(got, kvs):
    assert len(got) == len(kvs)
    for g, kv in zip(got, kvs, strict=True):
        assert g is not None and torch.equal(g, kv)


def _until_hits(shard, keys, tier):
    """Look up until every key is a hit in ``tier`` (fails after HANG_S): before a fault (a
    loaded machine may make a lookup late), and after one, with the breaker's cool-down over
    (the first lookups may be its probe, or meet reads the fault left behind)."""
    breaker = shard._lower_lookup.breakers.get(tier)
    if breaker is not None:
        breaker.cooldown_s = 1e-9
    deadline = time.monotonic() + HANG_S
    while (got := _lookup(shard, keys)) != [tier] * len(keys):
        assert time.monotonic() < deadline, f"still misses in {tier}: {got}"
        time.sleep(0.05)  # no busy loop while a probe or a left-over read is under way
    if breaker is not None:
        breaker.cooldown_s = shard._lower_lookup.cooldown_s


def _timed_out_lookups_open_the_breaker(shard, keys, tier):
    """Three lookups meet the fault: every key a miss by the deadline, counted; the third
    opens ``tier``'s breaker; then the tier is skipped (no reads, no new timeouts)."""
    before = dict(shard.counters)
    for _ in range(3):
        assert _lookup(shard, keys) == [None] * len(keys)
    c = dict(shard.counters)
    assert c["lookup_timeouts"] - before["lookup_timeouts"] == 3 * len(keys)
    assert c["misses"] - before["misses"] == 3 * len(keys)
    assert c["breaker_open"] - before["breaker_open"] == 1
    assert shard._lower_lookup.breakers[tier].state == "open"
    assert _lookup(shard, keys) == [None] * len(keys)  # open: skipped, nothing waits
    assert shard.counters["lookup_timeouts"] == c["lookup_timeouts"]


def _recovers(shard, keys, kvs, tier, read_in_fault=0, breaker_opened=True):
    """The fault is lifted: the breaker (when it opened) probes and closes, lookups hit in
    ``tier``, reads are exact. The first ``read_in_fault`` keys were read during the fault:
    their promotion may have gone on and landed in host memory since, so they are only read."""
    _until_hits(shard, keys[read_in_fault:], tier)
    if breaker_opened:
        assert shard.counters["breaker_half_open"] >= 1 and shard.counters["breaker_closed"] >= 1
    assert shard._lower_lookup.breakers[tier].state == "closed"
    _assert_exact(_read(shard, keys), kvs)


# -- network faults ---------------------------------------------------------------------------

def _ping(sock, send: bool = True) -> bytes:
    """One Redis PING on a raw socket (``send=False``: only wait for the reply): the reply's
    first bytes, b"" once the proxy closed the connection."""
    try:
        if send:
            sock.sendall(b"PING\r\n")
        return sock.recv(64)
    except (ConnectionResetError, BrokenPipeError):
        return b""


def test_tcp_proxy_modes_and_connection_bound(private_redis, proxies):
    """The harness's own tool: ``pass`` forwards, ``blackhole`` hangs (a timeout, never a reset)
    and its connections are closed when it ends, ``slow`` still delivers, the connection bound
    closes one more at once, and every thread ends on close (the fixture checks)."""
    server = private_redis()
    proxy = proxies("127.0.0.1", server.port)
    proxy.max_connections = 2
    assert proxy.via("redis://:pw@10.0.0.1:6379/0") == f"redis://:pw@127.0.0.1:{proxy.port}/0"
    with contextlib.ExitStack() as stack:
        c1 = stack.enter_context(socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S))
        c2 = stack.enter_context(socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S))
        assert _ping(c1) == _ping(c2) == b"+PONG\r\n"
        c3 = stack.enter_context(socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S))
        assert _ping(c3) == b""  # over the bound: closed at once
        assert proxy.stats["refused"] == 1

        proxy.set_mode(BLACKHOLE)
        c1.settimeout(0.5)
        with pytest.raises(TimeoutError):  # a hang: nothing comes back, nor does a reset
            _ping(c1)
        proxy.set_mode(PASS)
        c1.settimeout(HANG_S)
        assert _ping(c1, send=False) == b""  # it lost a request: closed as the black hole ends
        assert _ping(c2) == b"+PONG\r\n"  # idle meanwhile: forwards again

        proxy.set_mode(SLOW, delay_s=SLOW_DELAY_S)
        assert _ping(c2) == b"+PONG\r\n"
        assert proxy.stats["reads_delayed"] >= 2 and proxy.stats["bytes_dropped"] == len(b"PING\r\n")


def test_tcp_proxy_close_while_clients_connect_leaves_no_thread(private_redis):
    """close() racing new connections (CI on aa543c9: a link accepted as close() began had its
    thread started after close() listed the threads): every thread has ended when it returns,
    each time, and no connection is counted after it."""
    server = private_redis()
    for _ in range(10):
        proxy = TcpProxy("127.0.0.1", server.port).start()
        stop = threading.Event()

        def connect(port=proxy.port, stop=stop):
            while not stop.is_set():
                with contextlib.suppress(OSError), socket.create_connection(
                        ("127.0.0.1", port), timeout=HANG_S) as sock:
                    _ping(sock)

        clients = [threading.Thread(target=connect, daemon=True) for _ in range(4)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + HANG_S
        while proxy.stats["accepted"] < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        proxy.close()
        accepted = proxy.stats["accepted"]
        assert proxy.threads_alive() == 0
        stop.set()
        for c in clients:
            c.join(HANG_S)
        assert not any(c.is_alive() for c in clients)
        assert proxy.stats["accepted"] == accepted >= 1


def test_redis_black_hole_is_a_miss_by_the_deadline_opens_the_breaker_then_recovers(
        shards, proxies, private_redis, tmp_path):
    server = private_redis()
    proxy = proxies("127.0.0.1", server.port)
    shard = shards(tmp_path, redis_url=proxy.via(server.url))
    keys, kvs = _chunks(4)
    _below_host(shard, keys, kvs)
    _until_hits(shard, keys, "redis")

    proxy.set_mode(BLACKHOLE)
    _timed_out_lookups_open_the_breaker(shard, keys, "redis")
    errors = shard.shared[0].stats()["errors"]
    assert _read(shard, keys[:2], FAULT_READ_S) == [None, None]  # after io_timeout_s
    assert shard.shared[0].stats()["errors"] >= errors + 2
    assert proxy.stats["bytes_dropped"] > 0  # the requests did reach the black hole

    proxy.set_mode(PASS)
    _recovers(shard, keys, kvs, "redis", read_in_fault=2)


def test_redis_slow_proxy_is_late_for_lookups_but_never_wrong(
        shards, proxies, private_redis, tmp_path):
    server = private_redis()
    proxy = proxies("127.0.0.1", server.port)
    # the default io_timeout_s, over a round trip: the slow tier answers, late for lookups
    assert TiersConfig.io_timeout_s > 2 * SLOW_DELAY_S
    shard = shards(tmp_path, redis_url=proxy.via(server.url), io_timeout_s=TiersConfig.io_timeout_s,
                   lookup_timeout_s=SLOW_LOOKUP_TIMEOUT_S)
    keys, kvs = _chunks(4, seed=100)
    _below_host(shard, keys, kvs)

    proxy.set_mode(SLOW, delay_s=SLOW_DELAY_S)
    # a lookup misses every key by its deadline; whether the breaker then opens depends on
    # whether the late answers (successes) land before the next lookup's timeouts: not asserted
    before = shard.counters["lookup_timeouts"]
    assert _lookup(shard, keys) == [None] * len(keys)
    assert shard.counters["lookup_timeouts"] - before == len(keys)
    # a read that may wait (a promotion over a new connection: five round trips) gets the
    # right bytes, late
    _assert_exact(_read(shard, keys[:1]), kvs[:1])
    assert proxy.stats["reads_delayed"] > 0

    proxy.set_mode(PASS)
    _recovers(shard, keys, kvs, "redis", read_in_fault=1, breaker_opened=False)


def test_s3_black_hole_is_a_miss_by_the_deadline_opens_the_breaker_then_recovers(
        shards, proxies, s3_endpoint, tmp_path):
    endpoint, bucket = s3_endpoint
    host, port = endpoint.removeprefix("http://").split(":")
    proxy = proxies(host, int(port))
    shard = shards(tmp_path, s3_url=f"s3://{bucket}/faults-{uuid.uuid4().hex[:8]}",
                   s3_endpoint_url=proxy.via(endpoint))
    keys, kvs = _chunks(3, seed=200)
    _below_host(shard, keys, kvs)
    _until_hits(shard, keys, "s3")

    proxy.set_mode(BLACKHOLE)
    _timed_out_lookups_open_the_breaker(shard, keys, "s3")
    # a miss by get_refs' deadline (the promotion may go on: S3 attempts thrice)
    assert _read(shard, keys[:1], FAULT_READ_S) == [None]
    assert proxy.stats["bytes_dropped"] > 0

    proxy.set_mode(PASS)
    _recovers(shard, keys, kvs, "s3", read_in_fault=1)


def test_redis_server_sigstopped_is_a_miss_by_the_deadline_then_recovers_on_sigcont(
        shards, private_redis, tmp_path):
    server = private_redis()
    shard = shards(tmp_path, redis_url=server.url)
    keys, kvs = _chunks(4, seed=300)
    _below_host(shard, keys, kvs)
    _until_hits(shard, keys, "redis")

    with sigstopped(server.proc.pid):
        _timed_out_lookups_open_the_breaker(shard, keys, "redis")
        assert _read(shard, keys[:1], FAULT_READ_S) == [None]
        # puts keep answering from host memory; the write-down waits on Redis in background
        new_keys, new_kvs = _chunks(1, seed=350)
        assert shard.put(str(new_keys[0]), np.frombuffer(make_object(new_keys[0], new_kvs[0]),
                                                         np.uint8))
        assert _lookup(shard, new_keys) == ["host"]
    assert server.proc.poll() is None  # stopped, not killed

    _recovers(shard, keys, kvs, "redis", read_in_fault=1)


# -- disk full --------------------------------------------------------------------------------

#: a tmpfs of 640 KiB holds four chunk objects of 128 KiB (and the lock file), not seven: the
#: three early chunks and four late ones do not all fit, the four late ones alone do
TMPFS_BYTES = 640 * 1024
BIG_KV = dict(num_layers=4, num_tokens=64, num_kv_heads=2, head_dim=64)  # 128 KiB in bf16


@pytest.fixture
def tmpfs_root(tmp_path):
    with contextlib.ExitStack() as stack:
        try:
            yield stack.enter_context(small_tmpfs(str(tmp_path / "tmpfs"), TMPFS_BYTES))
        except TmpfsUnavailable as e:
            pytest.skip(f"no tmpfs for a full disk: {e}")


def test_full_disk_fails_write_downs_counted_and_earlier_chunks_stay_exact(shards, tmpfs_root):
    # the index allows 10 MiB; the disk has less
    shard = shards(tmpfs_root, disk_size_gib=0.01, lookup_timeout_s=NO_DEADLINE_S)
    assert shard.disk.capacity_bytes > TMPFS_BYTES
    early, early_kvs = _chunks(3, seed=400, **BIG_KV)
    _put(shard, early, early_kvs)
    assert shard.disk.contains(early) == [True] * 3
    assert shard.counters["write_errors"] == 0

    late, late_kvs = _chunks(4, seed=500, **BIG_KV)
    _put(shard, late, late_kvs)  # every put answers; the disk writes that do not fit fail
    on_disk = shard.disk.contains(late)
    assert not all(on_disk)
    assert shard.counters["write_errors"] == on_disk.count(False)
    assert shard.disk.stats()["errors"] == on_disk.count(False)
    assert not [n for _, _, names in os.walk(tmpfs_root) for n in names if n.startswith(".tmp-")]
    # the chunks the disk refused are still served from host memory, exact
    assert _lookup(shard, late) == ["host"] * 4
    _assert_exact(_read(shard, late), late_kvs)
    # the earlier chunks come up from the full disk, exact
    shard.host.delete(early)
    assert _lookup(shard, early) == ["disk"] * 3
    _assert_exact(_read(shard, early), early_kvs)

    # space is freed: the refused chunks are written down when put again
    refused = [k for k, ok in zip(late, on_disk, strict=True) if not ok]
    refused_kvs = [kv for kv, ok in zip(late_kvs, on_disk, strict=True) if not ok]
    assert shard.delete([str(k) for k in early]) == 3
    shard.delete([str(k) for k in refused])
    _below_host(shard, refused, refused_kvs)
    assert shard.disk.contains(refused) == [True] * len(refused)
    assert _lookup(shard, refused) == ["disk"] * len(refused)
    _assert_exact(_read(shard, refused), refused_kvs)


# -- bad objects ------------------------------------------------------------------------------

@pytest.fixture(params=["disk", "redis", "s3"])
def one_tier_shard(request, shards, tmp_path):
    """A shard whose only tier below host memory is ``request.param``, and that tier."""
    if request.param == "disk":
        cfg = {"disk_size_gib": 0.01}
    elif request.param == "redis":
        cfg = {"redis_url": request.getfixturevalue("private_redis")().url}
    else:
        endpoint, bucket = request.getfixturevalue("s3_endpoint")
        cfg = {"s3_url": f"s3://{bucket}/bad-{uuid.uuid4().hex[:8]}", "s3_endpoint_url": endpoint}
    shard = shards(tmp_path, lookup_timeout_s=NO_DEADLINE_S, **cfg)
    assert [t.name for t in shard.lower] == [request.param]
    return shard, shard.lower[0]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupt_object_in_a_tier_is_a_counted_miss_and_a_new_put_is_exact(one_tier_shard, how):
    shard, tier = one_tier_shard
    keys, kvs = _chunks(2, seed=600)
    _below_host(shard, keys, kvs)
    bad = corrupt_object(tier, keys[0], how)
    assert bytes(tier.get(keys[0])) == bad  # the tier holds the broken object

    got = _lookup(shard, keys)
    assert got[1] == tier.name  # its neighbour is untouched
    if how in ("header", "oversized"):  # the header itself is refused: a miss at lookup
        assert got[0] is None and shard.counters["read_errors"] == 1
    read = _read(shard, keys)
    assert read[0] is None  # a miss, never an exception nor wrong bytes
    _assert_exact(read[1:], kvs[1:])
    assert shard.counters["read_errors"] == (2 if how in ("header", "oversized") else 1)
    assert tier.contains(keys[:1]) == [False]  # the broken copy is deleted

    # a new put stores a good copy there, read back exact
    _below_host(shard, keys[:1], kvs[:1])
    assert _lookup(shard, keys[:1]) == [tier.name]
    _assert_exact(_read(shard, keys[:1]), kvs[:1])


def test_object_deleted_while_listed_falls_through_or_misses_then_a_new_put_is_exact(
        shards, s3_endpoint, tmp_path):
    endpoint, bucket = s3_endpoint
    shard = shards(tmp_path, disk_size_gib=0.01, s3_endpoint_url=endpoint,
                   s3_url=f"s3://{bucket}/gone-{uuid.uuid4().hex[:8]}",
                   lookup_timeout_s=NO_DEADLINE_S)
    disk, s3 = shard.lower
    keys, kvs = _chunks(2, seed=700)
    _below_host(shard, keys, kvs)
    assert _lookup(shard, keys) == ["disk", "disk"]

    # the disk file of keys[0] vanishes behind the index: the read falls through to S3, exact
    remove_object(disk, keys[0])
    assert disk.contains(keys[:1]) == [True]  # still listed
    errors = disk.stats()["errors"]
    _assert_exact(_read(shard, keys[:1]), kvs[:1])
    assert disk.stats()["errors"] == errors + 1
    assert shard.counters["promotions"] == 1

    # keys[1] is gone from both after a lookup listed it: a miss everywhere, no exception
    remove_object(disk, keys[1])
    remove_object(s3, keys[1])
    s3_misses = s3.stats()["misses"]
    assert _read(shard, keys[1:]) == [None]
    assert disk.stats()["errors"] == errors + 2 and s3.stats()["misses"] > s3_misses
    assert disk.contains(keys[1:]) == [False]  # the index forgot it
    assert _lookup(shard, keys[1:]) == [None]

    _below_host(shard, keys[1:], kvs[1:])
    assert _lookup(shard, keys[1:]) == ["disk"]
    _assert_exact(_read(shard, keys[1:]), kvs[1:])
