"""cluster.vllm.heap: the worker's rate-limited malloc_trim (issue 20's soak)."""

from __future__ import annotations

import ctypes

import pytest

from cluster.vllm.heap import HeapTrimmer, _libc_malloc_trim


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_trims_at_most_once_per_interval():
    clock, calls = _Clock(), []
    trimmer = HeapTrimmer(5.0, clock=clock, trim=lambda pad: calls.append(pad) or 1)
    assert trimmer.maybe_trim() is not None and calls == [0]
    clock.now += 4.9
    assert trimmer.maybe_trim() is None and calls == [0]
    clock.now += 0.1
    assert trimmer.maybe_trim() >= 0.0 and calls == [0, 0]


def test_a_failing_trim_is_not_counted_and_never_raises():
    def boom(pad):
        raise OSError("no")

    assert HeapTrimmer(0.0, trim=boom).maybe_trim() is None


def test_negative_interval_is_refused():
    with pytest.raises(ValueError, match="min_interval_s"):
        HeapTrimmer(-1.0)


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))


@pytest.mark.skipif(_libc_malloc_trim() is None, reason="C library without malloc_trim")
def test_libc_trim_returns_freed_arena_pages():
    """The fault the soak saw: ~1 MiB blocks come from the heap once a large block raised
    glibc's mmap threshold, and freeing them leaves the pages resident; a trim returns them."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(16 << 20))  # a freed mmapped block raises the dynamic threshold
    blocks, pins = [], []
    for _ in range(256):  # each block followed by a small live one: freed blocks cannot merge
        blocks.append(libc.malloc(1 << 20))
        pins.append(libc.malloc(4096))
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
    before = _rss_anon_kib()
    trimmer = HeapTrimmer(0.0)
    assert trimmer.available and trimmer.maybe_trim() is not None
    after = _rss_anon_kib()
    for p in pins:
        libc.free(p)
    assert before - after >= 128 << 10, (before, after)  # >= 128 of the 256 MiB came back
