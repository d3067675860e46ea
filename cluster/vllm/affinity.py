"""CPU affinity of kvblend's own threads inside a vLLM CPU worker.

vLLM's CPU worker binds its OpenMP threads to the cores of ``VLLM_CPU_OMP_THREADS_BIND`` and,
with them, its main thread (OpenMP thread 0) to the first of those cores. Every thread the
main thread starts afterwards inherits that one-core mask: Ray's core-worker threads, our
fetch and I/O threads. They would then share that core with OpenMP thread 0 while the other
cores wait at the end of each parallel region (seen 2026-11-29 with ``taskset``: every
thread of a worker on core 0 of ``0-1``; the effect on TTFT was not measured separately).

:func:`unpin_thread` gives the calling thread every CPU this process may use (the thread
initializer of our pools); :func:`all_cpus` does it temporarily around code that starts
threads (``ray.init``).
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)


def allowed_cpus() -> set[int]:
    """CPUs this process may use: the cgroup's cpuset when readable, else every CPU."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        cpus: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def unpin_thread() -> None:
    """Let the calling thread run on every allowed CPU (no-op where affinity is unsupported)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, allowed_cpus())  # Linux: 0 = the calling thread
    except OSError as e:
        log.debug("could not widen the CPU affinity of this thread: %s", e)


@contextlib.contextmanager
def all_cpus():
    """Run the block with the calling thread on every allowed CPU; threads started inside
    inherit that mask. The thread's own mask is restored afterwards."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    old = os.sched_getaffinity(0)
    unpin_thread()
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, old)
        except OSError:
            pass
