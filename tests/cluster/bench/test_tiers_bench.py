"""`kvblend bench tiers` end to end at tiny shapes: every tier, the JSON keys the issue names,
and numbers that are real measurements (positive, finite, ratio = get / baseline)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from cluster.bench import tiers as bench

pytestmark = pytest.mark.cluster


@pytest.fixture
def tiny_shape(monkeypatch):
    for name, value in (("NUM_LAYERS", 4), ("NUM_KV_HEADS", 2), ("HEAD_DIM", 16), ("NUM_TOKENS", 8)):
        monkeypatch.setattr(bench, name, value)


def test_bench_tiers_json(tiny_shape, tmp_path, redis_url, s3_endpoint):
    endpoint, bucket = s3_endpoint
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "tiers.json"
    args = parser.parse_args(["--json", str(out), "--quick", "--model", "random", "--reps", "1",
                              "--redis-url", redis_url, "--s3-url", f"s3://{bucket}/bench",
                              "--s3-endpoint-url", endpoint, "--device", "cpu"])
    assert bench.run(args) == 0
    result = json.loads(out.read_text())
    assert set(result["tiers"]) == {"host", "disk", "redis", "s3", "gpu"}
    for name, row in result["tiers"].items():
        variants = [row] + ([row["lz4_off"], row["lz4_on"]] if name != "gpu" else [])
        for r in variants:
            for k in ("get_gbps", "put_gbps", "baseline_gbps", "ratio", "layer_get_gbps"):
                assert math.isfinite(r[k]) and r[k] > 0, (name, k, r[k])
            assert r["ratio"] == pytest.approx(r["get_gbps"] / r["baseline_gbps"], rel=1e-2)
    assert result["tiers"]["disk"]["default_compression"] == "lz4"
    assert result["tiers"]["disk"]["get_gbps"] == result["tiers"]["disk"]["lz4_on"]["get_gbps"]
    assert "ratio_cold" in result["tiers"]["disk"]["lz4_off"]
    for data in ("real_kv", "random_bytes"):
        assert result["lz4"][data]["ratio"] > 0 and result["lz4"][data]["decompress_gbps"] > 0
    assert result["kv_source"].startswith("random")


def test_bench_rejects_unknown_tier():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(ValueError, match="unknown"):
        bench.run(parser.parse_args(["--tiers", "host,tape"]))
