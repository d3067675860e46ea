"""``kvblend bench faults`` at its smallest, as a user runs it (issue #20): one request per row
through ``vllm serve`` with the connector while Redis is black-holed, S3 is slowed, the shard is
SIGSTOPped, every copy of the passages is corrupted or deleted. Every request finishes with
the output full prefill gives (recompute ratio 1.0: the oracle), and each fault shows where it
should (the deadline and error counters moved). TTFTs are reported, not asserted."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
FAULT_ROWS = ("no_fault", "redis_blackhole", "s3_throttled", "shard_sigstop", "corrupt_objects", "deleted_object")


@pytest.mark.timeout(1800)  # its own guard: 1500 s
def test_bench_faults_every_request_answers_as_full_prefill(tmp_path):
    out = tmp_path / "faults.json"
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set in-process by other tests, not in a shell
    r = subprocess.run([str(BIN / "kvblend"), "bench", "faults", "--json", str(out), "--requests", "1",
                        "--passages", "2", "--workdir", str(tmp_path / "work")],
                       env=env, capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert set(rows) == {"full", *FAULT_ROWS}
    assert data["deadlines"]["lookup_timeout_s"] == 0.25 and data["deadlines"]["load_timeout_s"] == 2.0
    assert rows["full"]["requests"] == len(FAULT_ROWS) and rows["full"]["failed_requests"] == 0
    for name in FAULT_ROWS:
        row = rows[name]
        assert (row["requests"], row["failed_requests"], row["wrong_outputs"]) == (1, 0, 0), (name, row)
        assert row["ttft_p99_s"] > 0 and isinstance(row["within_deadline"], bool)
    # one prompt per row, four chunk segments: the chat template's frames bound segments (#35), so
    # the bench's prefix is the system message and the user message's "Passages:" label, then
    # the two passages
    assert all(rows[name]["segments"] == 4 for name in FAULT_ROWS), {n: rows[n]["segments"] for n in FAULT_ROWS}
    assert rows["no_fault"]["hit_segments"] >= 2                       # the passages, from disk
    assert rows["redis_blackhole"]["shard_counters"].get("lookup_timeouts", 0) >= 1
    assert rows["s3_throttled"]["shard_counters"].get("lookup_timeouts", 0) >= 1
    assert rows["shard_sigstop"]["injected"] == {"stopped": 1} and rows["shard_sigstop"]["hit_segments"] == 0
    corrupt = rows["corrupt_objects"]
    assert corrupt["injected"] == {"disk": 2, "redis": 2, "s3": 2}
    assert corrupt["shard_counters"].get("read_errors", 0) >= 1
    deleted = rows["deleted_object"]
    assert deleted["injected"] == {"disk": 2, "redis": 2, "s3": 2}
    assert deleted["hit_segments"] <= 2                                 # both deleted passages miss
    assert "redis_blackhole" in r.stdout and "bound on a fault row's TTFT p99" in r.stdout
