"""Child process of ``test_lora_tenants.py``: one vLLM engine (CPU, in this process) with the
kvblend connector and LoRA on, two adapters made here in PEFT's format on SmolLM2, and the
requests the test judges. A child because an engine with LoRA cannot share the test process
with the suite's other in-process engine (vLLM's connector group is one per process).

``python -m tests.integration._lora_engine <model dir> <work dir>`` writes
``<work dir>/result.json``: per request its lookup's ``path``, ``prefix_hits`` (prefix chunks
loaded) and ``segment_hits`` (blend segments loaded; the base model's path), greedy ``tokens``
and first-token ``logprobs`` ``{token id: logprob}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RANK = 8
CHUNK = 64  # tokens per prefix chunk


def make_adapter(folder: Path, model_dir: str, seed: int) -> None:
    """A PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) on every
    layer's ``q_proj`` and ``v_proj``, random A and B (B non-zero: the adapter changes the
    model's output, and so its KV)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for proj, out in (("q_proj", cfg.num_attention_heads * head_dim),
                          ("v_proj", cfg.num_key_value_heads * head_dim)):
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, cfg.hidden_size, generator=g) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.05
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": model_dir}))


def main(model_dir: str, work: Path) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    from blend.segments import build_blend_prompt
    from tests.cluster.vllm.helpers import (
        FULL,
        NO_RAY,
        SYSTEM,
        events,
        passage,
        settle,
        wait_stored,
    )

    stats = str(work / "stats.jsonl")
    adapters = {}
    for i, name in enumerate(("a", "b")):
        make_adapter(work / name, model_dir, seed=100 + i)
        adapters[name] = LoRARequest(name, i + 1, str(work / name))
    ktc = KVTransferConfig(
        kv_connector="KVBlendConnector", kv_connector_module_path="cluster.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"stats_path": stats, "recompute_ratios": [1.0], "min_tokens": 32,
                                   "chunk_size": CHUNK, "ray_address": NO_RAY,
                                   "allow_request_overrides": True})  # its kv_transfer_params (#37)
    llm = LLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=False, kv_transfer_config=ktc, seed=0,
              enable_lora=True, max_lora_rank=RANK, max_loras=2)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [passage(91), passage(92), passage(93)]
    q = "Question: Which item number belongs to the second passage? Answer:"
    ids, _ = build_blend_prompt(tok, SYSTEM + " Adapters apart.", texts, q)
    result = {"num_tokens": len(ids), "chunk_size": CHUNK}

    def run(tag: str, adapter: str | None, params: dict | None = None, store: bool = False) -> None:
        sp = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": params}
        out = llm.generate([{"prompt_token_ids": list(ids)}], sp, use_tqdm=False,
                           lora_request=adapters.get(adapter))[0]
        settle(llm)
        if store:
            wait_stored(stats, out.request_id)
        (lookup,) = events(stats, out.request_id, "lookup")
        result[tag] = {"path": lookup["path"], "prefix_hits": lookup.get("num_prefix_hits"),
                       "segment_hits": lookup.get("num_hit_segments"),
                       "tokens": list(out.outputs[0].token_ids),
                       "logprobs": {str(t): lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}}

    run("a_first", "a", store=True)   # stores its prefix chunks under a's keys
    run("b", "b", store=True)         # must not hit a's chunks; stores under b's
    run("a_again", "a")               # a's chunks hit
    run("base", None, store=True)     # the base model (blend path) hits neither
    for tag, adapter in (("a_full", "a"), ("b_full", "b"), ("base_full", None)):
        run(tag, adapter, FULL)
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
