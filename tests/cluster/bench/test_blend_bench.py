"""One-example smoke of ``kvblend bench blend`` (SmolLM2, 2 passages, short answers)."""

from __future__ import annotations

import json

import pytest

from cluster.cli.main import main

pytestmark = pytest.mark.integration


def test_bench_blend_smoke(tmp_path, smollm2_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "blend", "--json", str(out), "--num-examples", "1", "--max-passages", "2",
               "--ratios", "0,0.3,1.0", "--selection", "k_deviation,query_attention",
               "--max-new-tokens", "3", "--threads", "1"])
    assert rc == 0
    data = json.loads(out.read_text())["datasets"]["musique"]
    modes = ("full", "reuse", "k_deviation@0.3", "query_attention@0.3", "recompute_all")
    assert set(data["meta"]["modes"]) == set(modes[1:])
    for mode in modes:
        for key in ("ttft_s", "ttft_ratio", "ttft_ratio_iqr", "probe_share", "f1", "agreement",
                    "first_token_match", "kl_first", "nll_self", "gap_recovered", "nll_gold",
                    "recomputed_tokens", "reused_tokens", "agreement_ci90"):
            assert key in data[mode], (mode, key)
    # Ratio 1.0 recomputes everything: the same answer as full prefill (float32).
    assert data["recompute_all"]["agreement"] == 1.0 and data["recompute_all"]["first_token_match"] == 1.0
    assert data["recompute_all"]["kl_first"] < 1e-3
    assert data["reuse"]["reused_tokens"] > 0
    assert data["reuse"]["recomputed_tokens"] < data["k_deviation@0.3"]["recomputed_tokens"]
    # The probe runs in query_attention only, and is timed as part of TTFT.
    assert data["query_attention@0.3"]["probe_share"] > 0 and data["k_deviation@0.3"]["probe_share"] == 0
    ex = data["examples"][0]
    assert ex["query_attention@0.3"]["selection"] == "query_attention"
    assert ex["query_attention@0.3"]["recomputed_tokens"] == ex["k_deviation@0.3"]["recomputed_tokens"]
    assert (tmp_path / "bench.png").stat().st_size > 0
