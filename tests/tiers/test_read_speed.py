"""Host and disk reads at the speed of the medium (issue 16): host memory checks an object once
as it enters and copies it unchecked on every read after; disk checks each layer as it lands,
while it is still in the CPU's cache. Corruption stays a miss either way."""

from __future__ import annotations

import os

import pytest
import torch

import tiers.disk
import tiers.format
import tiers.host
import tiers.reader
from tests.factories import as_layer, layer_buffers, make_key, make_kv, make_object
from tiers.disk import DiskTier
from tiers.format import CODEC_LZ4, CODEC_RAW, FormatError, parse_header
from tiers.host import HostTier
from tiers.reader import ReadCounters, read_header, read_layers

pytestmark = pytest.mark.unit


def _count_calls(monkeypatch, module, name, log=None, tag=None):
    """Wrap ``module.name``; returns the list of calls (or appends ``tag`` to ``log``)."""
    real = getattr(module, name)
    calls = [] if log is None else log

    def spy(*args, **kwargs):
        calls.append(tag or name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _hashes(monkeypatch, log=None):
    """Every XXH3-64 the format module computes (the reader checks layers through it)."""
    import xxhash

    calls = [] if log is None else log
    real = xxhash.xxh3_64_intdigest

    class Spy:
        def __getattr__(self, name):
            return getattr(xxhash, name)

        @staticmethod
        def xxh3_64_intdigest(buf):
            calls.append("hash")
            return real(buf)

    monkeypatch.setattr(tiers.format, "xxhash", Spy())  # the reader checks through tiers.format
    return calls


def _mixed_kv():
    """Layers 0 and 2 compress (lz4), 1 and 3 do not (raw)."""
    kv = make_kv(num_layers=4, num_tokens=64, head_dim=16)
    kv[0] = make_kv(1, num_layers=1, num_tokens=64, head_dim=16, compressible=True)[0]
    kv[2] = 0
    return kv


# -- host: checked once, on entry ---------------------------------------------------------------
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "lz4"])
def test_host_reads_of_a_checked_object_hash_nothing(monkeypatch, compress):
    key, kv = make_key(1), _mixed_kv()
    obj = make_object(key, kv, compress=compress)
    assert {e.codec for e in parse_header(obj).layers} == ({CODEC_RAW, CODEC_LZ4} if compress else {CODEC_RAW})
    host = HostTier(1 << 20)
    hashes = _hashes(monkeypatch)
    assert host.put(key, obj)
    assert len(hashes) == kv.shape[0]                    # every layer checked once, on entry
    parses = _count_calls(monkeypatch, tiers.reader, "parse_header")
    hashes.clear()
    for _ in range(3):
        outs = layer_buffers(kv)
        assert read_layers(host, key, range(kv.shape[0]), outs) is not None
        assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))
        outs = layer_buffers(kv)[:2]
        assert read_layers(host, key, [3, 0], outs) is not None
        assert as_layer(outs[0], kv[3]).equal(kv[3]) and as_layer(outs[1], kv[0]).equal(kv[0])
    assert hashes == [] and parses == []                 # not on any read
    assert host.stats()["hits"] == 6 * 2                 # header + layers, as before


def test_host_caller_checked_object_is_not_hashed_again(monkeypatch):
    key, kv = make_key(2), make_kv()
    obj = make_object(key, kv)
    header = tiers.reader.validate_object(obj, key)
    hashes = _hashes(monkeypatch)
    assert HostTier(1 << 20).put(key, obj, header=header) and hashes == []


def test_host_keeps_checking_what_was_not_checked_on_entry(monkeypatch):
    """A bad object is stored as given and every read of it is a corrupt miss; an opaque
    buffer (put_object) and a header that is not the entry's (a stale cached one) are
    checked on every read."""
    key, kv = make_key(3), make_kv()
    good = make_object(key, kv)
    bad = bytearray(good)
    bad[parse_header(good).layers[1].offset + 3] ^= 0x10
    host = HostTier(1 << 20)
    assert host.put(key, bytes(bad)) and host.checked_header(key) is None
    for _ in range(2):
        counters = ReadCounters()
        assert read_layers(host, key, range(3), layer_buffers(kv), counters=counters) is None
        assert counters.snapshot()["corrupt"] == 1
    outs = layer_buffers(kv)                              # the good layers still read
    assert read_layers(host, key, [0, 2], outs[:2]) is not None

    opaque = make_key(4)
    arr = torch.frombuffer(bytearray(make_object(opaque, kv)), dtype=torch.uint8).numpy()
    arr[parse_header(arr).layers[2].offset] ^= 0x01
    assert host.put_object(opaque, arr, arr.nbytes)
    assert read_header(host, opaque) is not None
    counters = ReadCounters()
    assert read_layers(host, opaque, [2], layer_buffers(kv)[:1], counters=counters) is None
    assert counters.snapshot()["corrupt"] == 1

    # the same key re-encoded (lz4: other offsets and checksums), read with the old header
    ckey, ckv = make_key(5), make_kv(5, compressible=True)
    raw_header = parse_header(make_object(ckey, ckv))
    host.put(ckey, make_object(ckey, ckv, compress=True))
    hashes = _hashes(monkeypatch)
    counters = ReadCounters()
    assert read_layers(host, ckey, [0], layer_buffers(ckv)[:1], header=raw_header, counters=counters) is None
    assert counters.snapshot()["corrupt"] == 1 and hashes == ["hash"]


def test_host_forgets_the_check_with_the_entry_and_keeps_pins():
    kv = make_kv()
    keys = [make_key(10 + i) for i in range(3)]
    objs = [make_object(k, kv) for k in keys]
    host = HostTier(2 * len(objs[0]))
    assert host.put(keys[0], objs[0]) and host.put(keys[1], objs[1])
    assert host.pin([keys[0]]) == [True]
    assert host.put(keys[2], objs[2])                     # evicts keys[1], not the pinned one
    assert host.contains(keys) == [True, False, True]
    assert host.checked_header(keys[1]) is None and set(host._checked) == {keys[0], keys[2]}
    assert host.delete([keys[2]]) == 1 and set(host._checked) == {keys[0]}
    assert not host.put(keys[1], objs[1]) or host.contains([keys[0]]) == [True]
    host.unpin([keys[0]])
    assert host.put(keys[1], objs[1]) and host.checked_header(keys[1]) == parse_header(objs[1])


# -- disk: each layer checked as it lands ----------------------------------------------------
def test_disk_checks_each_layer_before_reading_the_next(tmp_path, monkeypatch):
    key, kv = make_key(20), make_kv(num_layers=4)
    disk = DiskTier(str(tmp_path), 1 << 20, fsync=False)
    disk.put(key, make_object(key, kv))
    header = read_header(disk, key)
    events: list[str] = []
    _count_calls(monkeypatch, tiers.disk.os, "preadv", events, "read")
    _hashes(monkeypatch, events)
    outs = layer_buffers(kv)
    assert read_layers(disk, key, range(4), outs, header=header) is not None
    assert events == ["read", "hash"] * 4                # not: one read, then four hashes
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in enumerate(outs))


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0], [1]])
def test_disk_mixed_lz4_and_raw_layers_bit_exact(tmp_path, order):
    key, kv = make_key(21), _mixed_kv()
    obj = make_object(key, kv, compress=True)
    assert [e.codec for e in parse_header(obj).layers] == [CODEC_LZ4, CODEC_RAW, CODEC_LZ4, CODEC_RAW]
    disk = DiskTier(str(tmp_path), 1 << 20, fsync=False)
    disk.put(key, obj)
    outs = layer_buffers(kv)[:len(order)]
    assert read_layers(disk, key, order, outs) is not None
    assert all(as_layer(o, kv[i]).equal(kv[i]) for i, o in zip(order, outs, strict=True))


@pytest.mark.parametrize("layer", [0, 1, 3])
def test_disk_corrupt_layer_stops_the_read_as_a_miss(tmp_path, layer):
    key, kv = make_key(22), _mixed_kv()
    obj = bytearray(make_object(key, kv, compress=True))
    obj[parse_header(obj).layers[layer].offset + 2] ^= 0x04
    disk = DiskTier(str(tmp_path), 1 << 20, fsync=False)
    disk.put(key, bytes(obj))
    counters = ReadCounters()
    assert read_layers(disk, key, range(4), layer_buffers(kv), counters=counters) is None
    assert counters.snapshot() == {"hits": 0, "misses": 0, "corrupt": 1, "oversized": 0}
    with open(disk._file(key), "r+b") as fh:             # truncated on disk: a miss too
        fh.truncate(len(obj) - 5)
    counters = ReadCounters()
    assert read_layers(disk, key, [3], layer_buffers(kv)[:1], counters=counters) is None
    assert counters.snapshot()["hits"] == 0


def test_disk_get_ranges_into_each_order_errors_and_descriptors(tmp_path):
    disk = DiskTier(str(tmp_path), 1 << 20, fsync=False)
    key = make_key(23)
    disk.put(key, bytes(range(200)))
    fds = len(os.listdir("/proc/self/fd"))
    outs = [bytearray(10), bytearray(20), bytearray(5)]
    seen = []
    assert disk.get_ranges_into_each(key, [(0, 10), (10, 20), (100, 5)], outs,
                                     lambda i: seen.append((i, bytes(outs[i]))))
    assert seen == [(0, bytes(range(10))), (1, bytes(range(10, 30))), (2, bytes(range(100, 105)))]

    def boom(i):
        raise FormatError("bad")

    with pytest.raises(FormatError):
        disk.get_ranges_into_each(key, [(0, 10)], outs[:1], boom)
    assert not disk.get_ranges_into_each(key, [(195, 10)], [bytearray(10)], seen.append)
    assert not disk.get_ranges_into_each(make_key(24), [(0, 1)], [bytearray(1)], seen.append)
    assert len(seen) == 3 and len(os.listdir("/proc/self/fd")) == fds   # nothing left open
    with pytest.raises(ValueError):
        disk.get_ranges_into_each(key, [(0, 10)], [bytearray(9)], seen.append)
