"""One-example smoke of ``kvblend bench blend`` (SmolLM2, 2 passages, short answers)."""

from __future__ import annotations

import json

from cluster.cli.main import main


def test_bench_blend_smoke(tmp_path, smollm2_path):
    out = tmp_path / "bench.json"
    rc = main(["bench", "blend", "--json", str(out), "--num-examples", "1", "--max-passages", "2",
               "--ratios", "0,1.0", "--max-new-tokens", "3", "--threads", "1"])
    assert rc == 0
    data = json.loads(out.read_text())
    for mode in ("full", "blend_0", "blend_1.0"):
        for key in ("ttft_s", "ttft_ratio", "f1", "agreement", "first_token_match", "kl_first",
                    "nll_self", "gap_recovered", "nll_gold", "recomputed_tokens", "agreement_ci90"):
            assert key in data[mode], (mode, key)
    # Ratio 1.0 recomputes everything: the same answer as full prefill (float32).
    assert data["blend_1.0"]["agreement"] == 1.0 and data["blend_1.0"]["first_token_match"] == 1.0
    assert data["blend_1.0"]["kl_first"] < 1e-3
    assert data["blend_0"]["reused_tokens"] > 0
    assert data["blend_0"]["recomputed_tokens"] < data["blend_1.0"]["recomputed_tokens"]
    assert (tmp_path / "bench.png").stat().st_size > 0
