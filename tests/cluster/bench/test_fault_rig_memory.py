"""The soak's memory reading (cluster.bench.fault_rig._proc_status_kib): RSS and its parts
from /proc, so a growing private heap can be told from touched shared-memory pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.bench.fault_rig import _proc_status_kib

pytestmark = pytest.mark.cluster

# A fresh interpreter that writes 64 MiB when told to, then waits: its heap grows by a known
# amount at a known moment. (Measured in the test process itself the write can land in pages
# earlier tests freed but the allocator kept, and RSS does not move: CI on aa543c9.)
_CHILD = """
import sys
sys.stdin.readline()
block = bytearray(b"\\x01") * (64 << 20)
print("written", flush=True)
sys.stdin.readline()
"""


def test_proc_status_splits_rss_and_sees_a_heap_grow():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        before = _proc_status_kib(child.pid)
        assert before["VmRSS"] > 0
        assert before["RssAnon"] + before["RssFile"] + before["RssShmem"] == before["VmRSS"]
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "written"
        after = _proc_status_kib(child.pid)
        assert after["RssAnon"] - before["RssAnon"] >= 60 << 10
        assert after["RssShmem"] - before["RssShmem"] < 4 << 10
    finally:
        child.stdin.write("done\n")
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()


def test_proc_status_of_a_gone_process_is_empty():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _proc_status_kib(child.pid) == {}
