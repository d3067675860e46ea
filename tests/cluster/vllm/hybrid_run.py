"""Run by test_hooks.py in a fresh process (``python -m tests.cluster.vllm.hybrid_run MODEL
STATS MODE`` from the repository root): a tiny hybrid model (full and sliding-window attention
layers) in stock vLLM with the hybrid KV cache manager left to vLLM, ``MODE`` ``connector``
(KVBlendConnector) or ``plain`` (no connector). In-process engine core, float32, greedy. Prints
one ``RESULT`` JSON line: the outputs, vLLM's KV cache groups and HMA setting, and for the
connector its roles' ``enabled`` and the warnings it logged.

A fresh process per engine: vLLM keeps one worker-side connector per process
(``kv_transfer_state._KV_CONNECTOR_AGENT``), so an engine with a connector cannot share a
process with the tests' ``blend_llm``.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def make_hybrid_model(out_dir: str, tokenizer_dir: str, *, sliding_window: int = 64,
                      layer_types: tuple[str, ...] = ("full_attention", "sliding_attention") * 2) -> str:
    """A randomly initialised 4-layer Llama whose layers of ``layer_types`` (read by vLLM's
    ``LlamaAttention``; by default 1 and 3) use a window of ``sliding_window`` tokens, with
    ``tokenizer_dir``'s tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=2048, sliding_window=sliding_window, initializer_range=0.2,
                         layer_types=list(layer_types), tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


if __name__ == "__main__":
    model_path, stats_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    records = _Records()
    logging.getLogger("kvblend.connector").addHandler(records)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from blend.segments import build_blend_prompt
    from cluster.vllm.events import read_events
    from tests.cluster.vllm.helpers import NO_RAY, SYSTEM, passage

    ktc = None
    if mode == "connector":
        ktc = KVTransferConfig(kv_connector="KVBlendConnector", kv_connector_module_path="cluster.connector",
                               kv_role="kv_both", kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"stats_path": stats_path, "min_tokens": 32,
                                                          "chunk_size": 64, "ray_address": NO_RAY})
    hma = {"disable_hybrid_kv_cache_manager": True} if len(sys.argv) > 4 and sys.argv[4] == "no-hma" else {}
    llm = LLM(model_path, dtype="float32", enforce_eager=True, max_model_len=1024, max_num_batched_tokens=1024,
              enable_prefix_caching=False, kv_transfer_config=ktc, seed=0, **hma)
    tok = AutoTokenizer.from_pretrained(model_path)
    texts = [passage(950 + i, num_sentences=6) for i in range(3)]
    q = "Question: Which passage mentions a canal? Answer:"
    ids1, _ = build_blend_prompt(tok, SYSTEM, texts, q)
    ids2, _ = build_blend_prompt(tok, SYSTEM, [texts[2], texts[0], texts[1]], q)
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    outs = []
    for ids in (ids1, ids2, ids2):  # cold, then the reordered prompt twice (a blend, were it active)
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        first = out.outputs[0].logprobs[0]
        outs.append({"token_ids": list(out.outputs[0].token_ids),
                     "first_logprobs": {str(t): lp.logprob for t, lp in first.items()}})
    core = llm.llm_engine.engine_core.engine_core
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    result = {"outputs": outs, "num_tokens": len(ids2),
              "disable_hybrid_kv_cache_manager": llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
              "kv_cache_groups": [type(g.kv_cache_spec).__name__ for g in groups]}
    if mode == "connector":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        result.update(scheduler_enabled=core.scheduler.connector.enabled,
                      worker_enabled=get_kv_transfer_group().enabled,
                      warnings=records.lines,
                      events=sorted({e["event"] for e in read_events(stats_path)}))
    print("RESULT " + json.dumps(result), flush=True)
