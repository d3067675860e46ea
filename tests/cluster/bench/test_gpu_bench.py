"""``kvblend bench gpu``: its help needs none of the service clients, and a tiny run on the
CPU writes every column of its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from blend.selection import num_to_select

BLOCKER = ("import sys\n"
           "for m in ('ray', 'redis', 'boto3', 'lz4', 'vllm'):\n"
           "    sys.modules[m] = None\n"
           "from cluster.cli.main import main\n"
           "sys.exit(main(['bench', 'gpu', '--help']))\n")


def test_bench_gpu_help_without_heavy_modules():
    proc = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--json" in proc.stdout and "--page-cache" in proc.stdout


def test_bench_gpu_tiny_runs_end_to_end(tmp_path):
    from cluster.cli.main import main

    path = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--json", str(path), "--tiny", "--device", "cpu", "--lengths", "300",
               "--chunk-tokens", "64", "--repeats", "1", "--disk-dir", str(tmp_path / "disk")])
    assert rc == 0
    row = json.loads(path.read_text())["results"]["300"]
    for key in ("full_s", "blend_gpu_s", "blend_host_s", "blend_disk_s", "ratio_host", "h2d_gbps",
                "h2d_baseline_gbps", "overlap"):
        assert isinstance(row[key], float) and row[key] >= 0, key
    assert row["ratio_host"] == pytest.approx(row["blend_host_s"] / row["full_s"])
    assert row["overlap"] == pytest.approx(row["blend_host_s"] / row["blend_gpu_s"])
    assert row["selected_tokens"] == num_to_select(row["reused_tokens"], 0.15)
    assert row["disk_read_counters"]["hits"] > 0 and row["disk_read_counters"]["corrupt"] == 0
