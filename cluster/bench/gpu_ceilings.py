"""What ``kvblend bench gpu`` measures beside the blend: the machine's own ceilings and a profile.

* :func:`drop_page_cache` — before each disk-tier run, so the disk is read, not the page cache;
* :func:`disk_raw_gbps` — the chunk files read whole with 8 threads, no checksums: the disk's
  own rate, against which the disk tier is judged;
* :func:`h2d_baseline_gbps` — pinned ``copy_`` host-to-device on a side stream: the rate the
  host tier's staging copies are judged against;
* :func:`profile_blend` — one blend under ``torch.profiler``: tables by CPU and by device
  time, and a summary (wall, device busy, kernel launches, host syncs).

Used by :class:`cluster.bench.gpu_harness.GpuBench` and the placement and client benches.
Only the standard library is imported at module level.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: Profiler rows that are host waits for the device, and kernel launches.
SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def drop_page_cache(paths: list[str], how: str) -> str:
    """Evict ``paths`` from the page cache: ``how`` is ``keep`` (nothing), ``drop``
    (``/proc/sys/vm/drop_caches``, machine-wide, falling back to fadvise) or ``fadvise``
    (``POSIX_FADV_DONTNEED`` per file). Returns what was done, for the JSON."""
    if how == "keep":
        return "kept (warm page cache)"
    if how == "drop":
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "dropped (drop_caches)"
        except OSError:
            pass
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError):
            return "not dropped (no drop_caches, no fadvise)"
    return "fadvise DONTNEED per file" + (" (drop_caches not allowed)" if how == "drop" else "")


def disk_raw_gbps(paths: list[str], page_cache: str) -> float:
    """GB/s of reading ``paths`` whole (8 threads, page cache dropped as for the disk runs,
    no checksums): the disk's own ceiling for the disk tier."""
    from concurrent.futures import ThreadPoolExecutor

    drop_page_cache(paths, page_cache)

    def read(path: str) -> int:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            return f.readinto(buf)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(read, paths))
    return total / (time.perf_counter() - t0) / 1e9


def h2d_baseline_gbps(device, nbytes: int, num_copies: int) -> float:
    """GB/s of ``num_copies`` pinned ``copy_`` of ``nbytes`` each to ``device`` on a side
    stream, best of 3 (0.0 for ``nbytes <= 0``)."""
    import torch

    if nbytes <= 0:
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for _ in range(num_copies):
                dst.copy_(src, non_blocking=True)
            end.record()
        end.synchronize()
        best = max(best, nbytes * num_copies / (start.elapsed_time(end) / 1e3) / 1e9)
    return best


def profile_blend(fn: Callable[[], object], sync: Callable[[], None], device, length: int, path: str) -> dict:
    """Run ``fn`` (one blend) once unprofiled, then once under ``torch.profiler``; write the
    tables by self CPU time and (CUDA) by device time to ``path``; returns
    :func:`profile_summary` of the profiled run."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    table = prof.key_averages()
    summary = profile_summary(table, wall)
    with open(path, "w") as f:
        f.write(f"one host-tier blend at {length} tokens: {summary}\n\n== by self CPU time ==\n")
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=30))
        if device.type == "cuda":
            f.write("\n\n== by device time ==\n")
            f.write(table.table(sort_by="self_device_time_total", row_limit=30))
    return summary


def profile_summary(table, wall_s: float) -> dict:
    """Wall seconds, device-busy seconds (sum of kernel and copy self time on the device),
    kernel launches and host syncs of one profiled run (``key_averages()`` rows)."""
    busy_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in table)
    launches = sum(e.count for e in table if e.key in LAUNCHES)
    syncs = sum(e.count for e in table if e.key in SYNCS)
    return {"wall_s": wall_s, "device_busy_s": busy_us / 1e6,
            "device_idle_s": max(0.0, wall_s - busy_us / 1e6),
            "kernel_launches": launches, "host_syncs": syncs}
