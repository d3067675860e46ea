"""The main job at tiny size (`kvblend demo`), and examples/blend_rag.py, as a user runs them."""

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


def _env() -> dict:
    env = dict(os.environ)
    # tests/cluster/vllm's in-process engines set this in our environment; a user's shell has it unset.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    return env


@pytest.mark.timeout(1800)  # its own guard: 1500 s
def test_demo_tiny(tmp_path):
    out = tmp_path / "demo.json"
    r = subprocess.run([str(BIN / "kvblend"), "demo", "--num-queries", "2", "--passages-per-query", "3",
                        "--prefix-queries", "1", "--workdir", str(tmp_path / "work"), "--json", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data) >= {"kvblend", "full", "vllm_prefix"}
    for mode in ("kvblend", "full", "vllm_prefix"):
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_ratio", "serving_s", "agreement"):
            assert data[mode][key] >= 0
        assert data[mode]["ttft_p90_s"] >= data[mode]["ttft_p50_s"]
    assert data["full"]["ttft_ratio"] == 1.0 and data["full"]["agreement"] == 1.0
    meta = data["_meta"]
    assert (meta["num_queries"], meta["passages_per_query"]) == (2, 3)
    assert meta["mean_prompt_tokens"] > 0 and sorted(meta["modes"]) == ["full", "kvblend", "vllm_prefix"]
    assert meta["elapsed_s"] > sum(data[m]["serving_s"] for m in ("kvblend", "full", "vllm_prefix"))
    assert {"engines start", "full serving", "vllm_prefix serving", "ingest", "kvblend serving"} <= set(meta["steps"])
    assert meta["ingest"]["stored"] > 0 and meta["ingest"]["tokens"] > 0
    kv = data["kvblend"]
    assert kv["blended_requests"] >= 2, kv       # the blend path ran in the replicas
    assert kv["hit_rate"] > 0.5, kv               # ingested passages were found by the replicas
    assert kv["reused_tokens"] > 0 and kv["recomputed_tokens"] > 0
    assert kv["fallbacks"] == 0
    # vllm_prefix answers a subset (issue 36), compared with full prefill's answers to the same queries
    assert (data["vllm_prefix"]["queries"], data["full"]["queries"], kv["queries"]) == (1, 2, 2)
    assert meta["prefix_queries"] == 1
    # where kvblend's TTFT went, per request, from the client's clock and the connector's events
    bd = kv["ttft_breakdown"]
    assert bd["sent"] == 2 and bd["explained"] >= 1, bd
    for row in bd["requests"]:
        tiled = row["front_s"] + row["plan_s"] + row["to_load_s"] + row["load_s"] + row["after_load_s"]
        assert abs(tiled - row["ttft_s"]) < 1e-6 and row["load_s"] > 0 and row["plan_s"] > 0
    assert kv["waited_s"] >= 0
    assert "kvblend TTFT breakdown" in r.stdout
    assert (tmp_path / "work" / "demo-ttft.png").stat().st_size > 1000
    assert "kvblend demo" in r.stdout             # the table was printed
    assert "ingest (before serving" in r.stdout and "next:" in r.stdout and str(out) in r.stdout


@pytest.mark.timeout(1200)  # its own guard: 900 s
def test_examples_blend_rag_runs_as_is():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "blend_rag.py")], env=_env(),
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if "TTFT" in line]
    assert len(lines) == 3, r.stdout
    assert "hits 1/4" in lines[0]           # cold: the system prompt (the warm-up stored it)
    assert "hits 4/4" in lines[1] and "hits 4/4" in lines[2]   # reordered: every chunk a hit
