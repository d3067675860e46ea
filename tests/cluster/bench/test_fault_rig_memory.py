"""The soak's memory reading (cluster.bench.fault_rig._proc_status_kib): RSS and its parts
from /proc, so a growing private heap can be told from touched shared-memory pages."""

from __future__ import annotations

import os
import subprocess
import sys

from cluster.bench.fault_rig import _proc_status_kib


def test_proc_status_splits_rss_and_sees_a_heap_grow():
    before = _proc_status_kib(os.getpid())
    assert before["VmRSS"] > 0
    assert before["RssAnon"] + before["RssFile"] + before["RssShmem"] == before["VmRSS"]
    block = b"\x01" * (64 << 20)  # written, so resident
    after = _proc_status_kib(os.getpid())
    assert after["RssAnon"] - before["RssAnon"] >= 60 << 10
    del block


def test_proc_status_of_a_gone_process_is_empty():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _proc_status_kib(child.pid) == {}
