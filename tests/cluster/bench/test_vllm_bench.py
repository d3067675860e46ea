"""``kvblend bench vllm`` smoke: one MuSiQue row, two passages, every mode in its own engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]  # the bench's guard: 900 s


def test_bench_vllm_one_example(tmp_path):
    out = tmp_path / "vllm.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "cluster.cli.main", "bench", "vllm", "--json", str(out),
                           "--num-examples", "1", "--max-passages", "2", "--max-new-tokens", "2",
                           "--selection", "query_attention"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(out.read_text())
    assert got["num_examples"] == 1 and set(got["modes"]) == {"full", "vllm_prefix", "kvblend"}
    for row in got["modes"].values():
        assert 0 < row["ttft_s"] <= row["ttft_p90_s"] and row["e2e_s"] >= row["ttft_s"]
        assert len(row["answers"]) == 1
    assert got["modes"]["full"]["ttft_ratio"] == 1.0 and got["modes"]["full"]["hit_rate"] == 0.0
    kv = got["modes"]["kvblend"]
    # the warm-up (passages reversed) stored both passages: the measured prompt hits both
    assert kv["segment_hit_rate"] == 1.0 and kv["fallbacks"] == 0 and kv["hit_rate"] > 0.5
    assert kv["selection"] == "query_attention"
