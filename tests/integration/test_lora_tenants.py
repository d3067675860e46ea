"""Issue 19 item 3 through vLLM: KV never crosses a LoRA adapter. Two adapters made locally in
PEFT's format on SmolLM2 (``_lora_engine.make_adapter``), served by one vLLM engine with the
connector and LoRA on (in a child process, ``_lora_engine``): the prefix chunks a request under
adapter ``a`` stored hit for ``a`` only; ``b`` and the base model miss them, and every output
equals that adapter's (or the base model's) own computation with the cache off. Before
``prefix_only``, the store of a blend segment under an adapter failed in our own prefill. The adapters
change the model (their outputs differ from the base model's), so a shared chunk would show."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 900  # the only timing: a hang guard for the child's engine start and requests


@pytest.fixture(scope="module")
def lora_run(smollm2_path, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("lora")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    done = subprocess.run([sys.executable, "-m", "tests.integration._lora_engine", smollm2_path, str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads((work / "result.json").read_text())


def _close(got: dict, ref: dict, atol: float = 2e-3) -> bool:
    return set(got["logprobs"]) == set(ref["logprobs"]) and all(
        math.isclose(got["logprobs"][t], lp, abs_tol=atol) for t, lp in ref["logprobs"].items())


def test_chunks_stored_under_one_adapter_hit_for_it_only(lora_run):
    """Under an adapter the connector reuses prefix chunks (blend segments would need the
    adapter in its own prefill: cluster.vllm.tenant.prefix_only)."""
    r = lora_run
    whole = (r["num_tokens"] - 1) // r["chunk_size"]  # chunks ending before the last token
    assert whole >= 2
    assert r["a_first"]["prefix_hits"] == 0
    assert r["b"]["prefix_hits"] == 0                   # a's chunks are not b's
    assert r["a_again"]["path"] == "prefix" and r["a_again"]["prefix_hits"] == whole
    assert r["base"]["segment_hits"] == 0               # nor the base model's


def test_each_adapters_output_is_its_own_computation(lora_run):
    r = lora_run
    assert r["b"]["tokens"] == r["b_full"]["tokens"] and _close(r["b"], r["b_full"])
    assert r["base"]["tokens"] == r["base_full"]["tokens"] and _close(r["base"], r["base_full"])
    assert r["a_again"]["tokens"] == r["a_full"]["tokens"] and _close(r["a_again"], r["a_full"])
    # the adapters matter: were KV shared across them, outputs would show it
    assert not _close(r["a_full"], r["base_full"], atol=1e-2)
    assert not _close(r["a_full"], r["b_full"], atol=1e-2)
