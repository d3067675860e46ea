"""``kvblend bench gpu``: its help needs none of the service clients, and a tiny run on the
CPU writes every column of its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from blend.selection import num_to_select

pytestmark = pytest.mark.cluster

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
    out = json.loads(path.read_text())
    assert out["ratios"] == [0.05, 0.15, 0.3] and "build_worker_source" in out["source"]
    # the class a vLLM worker blends with (blend.adapters.vllm.vllm_adapter) computes the layers
    assert out["model"]["compute_class"] == "blend.adapters.fused_layers.FusedLlamaLayers"
    assert out["model"]["warm_up_s"] > 0
    row = out["results"]["300"]
    assert row["repeats"] == 1 and row["full_min_s"] <= row["full_s"] <= row["full_max_s"]
    for ratio, cell in row["by_ratio"].items():
        for key in ("full_s", "blend_gpu_s", "blend_host_s", "blend_host_cold_s", "blend_disk_s",
                    "ratio_host", "h2d_gbps", "h2d_baseline_gbps", "overlap"):
            assert isinstance(cell[key], float) and cell[key] >= 0, key
        for tier in ("gpu", "host", "host_cold", "disk"):
            assert cell[f"blend_{tier}_min_s"] <= cell[f"blend_{tier}_s"] <= cell[f"blend_{tier}_max_s"]
        assert cell["ratio_host"] == pytest.approx(cell["blend_host_s"] / row["full_s"])
        assert cell["overlap"] == pytest.approx(cell["blend_host_s"] / cell["blend_gpu_s"])
        assert cell["selected_tokens"] == num_to_select(cell["reused_tokens"], float(ratio))
        assert cell["disk_read_counters"]["hits"] > 0
        # Selections side by side (issue 17): the product's default first, K deviation beside it.
        assert cell["selection"] == "query_attention" and list(cell["selections"]) == ["k_deviation"]
        assert cell["probe_s"] > 0
        other = cell["selections"]["k_deviation"]
        assert other["probe_s"] == 0 and other["selected_tokens"] == cell["selected_tokens"]
        assert other["ratio_host"] == pytest.approx(other["blend_host_s"] / row["full_s"])


@pytest.mark.timeout(600)
def test_bench_gpu_clients_tiny_runs_every_client_and_state(tmp_path):
    """``--client`` (issue 32): every client the product builds, cold and churn, over a real
    shard; no chunk-layer missed, no blend fell back, and the agent's objects crossed through
    its arena (a child process: the bench starts and stops its own Ray cluster)."""
    path = tmp_path / "clients.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli.main", "bench", "gpu", "--client", "agent,ray,local",
                           "--tiny", "--device", "cpu", "--lengths", "600", "--chunk-tokens", "64",
                           "--repeats", "2", "--churn-lengths", "600", "--ratios", "0.15",
                           "--disk-dir", str(tmp_path / "disk"), "--json", str(path)],
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(path.read_text())
    rows = {(r["client"], r["state"]): r for r in out["rows"]}
    assert set(rows) == {(c, s) for c in ("agent", "ray", "local") for s in ("cold", "churn")}
    for row in rows.values():
        assert row["transfer_missed_layers"] == 0 and row["blend_fell_back_runs"] == 0, row
        for leg in ("transfer", "blend"):
            assert 0 < row[f"{leg}_min_s"] <= row[f"{leg}_s"] <= row[f"{leg}_max_s"], (leg, row)
        assert row["ratio_to_full"] == pytest.approx(row["blend_s"] / row["full_s"])
    agent = out["agent_stats"]
    assert agent["arena"]["arena_peak_bytes"] > 0 and agent["client"]["arena_full"] == 0
    assert agent["client"]["lookups"] > 0 and agent["agent"]["up"] is True


@pytest.mark.timeout(600)
def test_bench_gpu_placement_tiny_times_every_way_and_placement(tmp_path):
    """Issue 34's benchmark at its smallest: every placement, full prefill / always-load /
    cost-aware interleaved, the cost-aware choices recorded, the settling run's three phases."""
    from cluster.bench.gpu_placement import PLACEMENTS
    from cluster.cli.main import main

    path = tmp_path / "placement.json"
    rc = main(["bench", "gpu", "--json", str(path), "--tiny", "--device", "cpu", "--lengths", "300",
               "--chunk-tokens", "32", "--repeats", "2", "--placement", "all", "--disk-dir", str(tmp_path / "disk")])
    assert rc == 0
    out = json.loads(path.read_text())
    assert [r["placement"] for r in out["rows"]] == list(PLACEMENTS)
    for r in out["rows"]:
        assert r["repeats"] == 2 and len(r["choices"]) == 2, r
        for way in ("full", "always_load", "cost_aware"):
            assert 0 < r[f"{way}_min_s"] <= r[f"{way}_s"] <= r[f"{way}_max_s"], (r["placement"], way)
        assert all(c == "full" or c == "load" or c.startswith("recompute:") for c in r["choices"])
    assert set(out["settling"]) == {"tokens", "fast", "slowed", "recovered"}
    for phase in ("fast", "slowed", "recovered"):  # the estimate after each request, beside its choice
        got = out["settling"][phase]
        assert len(got["estimated_gbps"]) == len(got["choices"]) and all(g is None or g > 0
                                                                          for g in got["estimated_gbps"])
    assert "slow" in out["estimates"]["tiers"] and out["estimates"]["blend_s_per_work"] > 0
    assert "agent" in out["left_out"]


def test_a_timed_blend_runs_the_worker_s_per_layer_writes(tmp_path):
    """Every blend the bench times calls the vLLM worker's per-layer callback
    (:class:`cluster.vllm.paged.ClaimedLayerWrites`): after one, the bench's paged cache holds
    that blend's final KV of every layer, bit for bit, at slots ``0..T-1``."""
    import argparse

    import torch

    from blend.config import parse_selections
    from cluster.bench.gpu import add_arguments
    from cluster.bench.gpu_harness import GpuBench
    from cluster.vllm.paged import gather_kv

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--json", str(tmp_path / "x.json"), "--tiny", "--device", "cpu", "--lengths", "300",
                         "--chunk-tokens", "64", "--repeats", "1", "--disk-dir", str(tmp_path / "disk")])
    args.ratios, args.selection = [0.15], parse_selections(args.selection)
    bench = GpuBench(args, torch.device("cpu"), [300])
    try:
        assert "ClaimedLayerWrites" in bench.model_desc["layer_callback"] and args.probe_graphs == "off"
        plan, num_chunks = bench._plan(300, 0.15)
        result = bench._blend_fn(plan, "host", num_chunks)()
        slots = torch.arange(plan.blend_end)
        assert len(bench._paged) == len(result.kv) == bench.spec.num_layers
        for cache, kv in zip(bench._paged, result.kv, strict=True):
            assert torch.equal(gather_kv(cache, "flash_attn", slots), kv[:, :plan.blend_end])
    finally:
        bench.close()


def test_probe_graphs_both_builds_the_worker_s_buckets_and_times_each_way(tmp_path):
    """``--probe-graphs both``: the buckets come from the worker's start-up function (every
    bucket up to the longest prompt, not one per prompt), and each cell times the gpu and hot
    host tiers with and without them (on the CPU the buckets run their steps uncaptured)."""
    from cluster.cli.main import main

    path = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--json", str(path), "--tiny", "--device", "cpu", "--lengths", "300",
               "--chunk-tokens", "64", "--repeats", "1", "--ratios", "0.15", "--selection", "query_attention",
               "--probe-graphs", "both", "--disk-dir", str(tmp_path / "disk")])
    assert rc == 0
    out = json.loads(path.read_text())
    built = out["model"]["probe_graphs"]
    assert built["max_tokens"] == 300 + 512 and built["broken"] is None
    assert built["num_buckets"] == len(built["buckets"]) >= 10  # 128 and 256 rows over every key bucket
    row = out["results"]["300"]
    assert row["probe_graphs"]["ready"] and row["probe_graphs"]["buckets"] == built["buckets"]  # nothing new
    both = row["by_ratio"]["0.15"]["with_probe_graphs"]
    for tier in ("gpu", "host"):
        for way in ("off", "on"):
            assert both[f"blend_{tier}_{way}_min_s"] <= both[f"blend_{tier}_{way}_s"] <= both[f"blend_{tier}_{way}_max_s"]
            assert both[f"probe_{tier}_{way}_s"] > 0
    assert both["graphs"]["layer_runs"] > 0  # the "on" blends ran the buckets, the "off" ones none
    for tier in ("gpu", "host"):
        assert both[f"graphs_ran_{tier}"] and both[f"replayed_layers_{tier}_off"] == 0
    assert row["start_up"]["probe_graphs"]["buckets"] == built["buckets"]
