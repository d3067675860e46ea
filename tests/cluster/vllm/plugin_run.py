"""Run by test_plugin.py in a fresh process (``python -m tests.cluster.vllm.plugin_run`` from the
repository root): stock vLLM, the connector by its short name only
(registered by the kvblend ``vllm.general_plugins`` entry point), engine core in its own
process, bf16, vLLM prefix caching ON. Prints one JSON object with the outputs."""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    model_path, stats_path = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from blend.segments import build_blend_prompt
    from cluster.vllm.events import read_events
    from tests.cluster.vllm.helpers import NO_RAY, passage

    tok = AutoTokenizer.from_pretrained(model_path)
    ktc = KVTransferConfig(kv_connector="KVBlendConnector", kv_role="kv_both",
                           kv_load_failure_policy="recompute",
                           kv_connector_extra_config={"stats_path": stats_path, "min_tokens": 32,
                                                      "ray_address": NO_RAY, **extra})
    llm = LLM(model_path, dtype="bfloat16", enforce_eager=True, max_model_len=4096,
              enable_prefix_caching=True, kv_transfer_config=ktc)
    system = "You are a helpful assistant. Answer the question using the passages."
    texts = [passage(900 + i, num_sentences=8) for i in range(3)]
    q = "Question: Which passage mentions a canal? Answer:"
    ids1, _ = build_blend_prompt(tok, system, texts, q)
    ids2, _ = build_blend_prompt(tok, system, [texts[2], texts[0], texts[1]], q)
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    outs = []
    # "reader": another engine that only sends the reordered prompt (the chunks come from the
    # shared cache, stored by an earlier engine)
    requests = (ids2,) if os.environ.get("PLUGIN_RUN_PHASE") == "reader" else (ids1, ids2, ids2)
    for i, ids in enumerate(requests):
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        outs.append({"request_id": out.request_id, "token_ids": list(out.outputs[0].token_ids)})
        if i == 0 and len(requests) > 1:  # the cold request's chunks are stored after it: wait
            # for all four (the system prompt, gathered from the paged KV, and 3 passages computed)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and sum(
                    e.get("stored", 0) for e in read_events(stats_path) if e["event"] == "store") < 4:
                time.sleep(0.2)
    print("RESULT " + json.dumps({"outputs": outs, "num_tokens": len(ids2)}), flush=True)
