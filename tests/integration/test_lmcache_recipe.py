"""Issue 21: LMCache's documented blend flow hits through our ``vllm serve``.

LMCache's online example (examples/blend_kv_v1: ``blending.yaml`` through
``LMCACHE_CONFIG_FILE``, ``blend_online_client.py`` over the OpenAI completions API) precomputes
``sys # # chunk1``, ``chunk2`` and ``chunk3`` as three requests, then sends
``sys # # chunk2 # # chunk1 # # chunk3 # # question`` as one string. Here the same, with
``--tokenizer-mode kvblend`` (segment-wise tokenization) and the connector on the
machine-local cache (no Ray): the blend request hits the system prompt and all three chunks;
the same prompt tokenized as one string (BPE merges across ``" # # "``) misses the chunks; and
a prompt with no system prompt has its first passage reused in another position (and a stored
chunk used first). One ``vllm serve`` start.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import sys
import time

import pytest

from tests.serving import http_server

pytestmark = pytest.mark.slow

BIN = pathlib.Path(sys.executable).parent
SEP = " # # "
#: LMCache's examples/blend_kv_v1/blending.yaml, key for key
LMCACHE_YAML = ('chunk_size: 256\nenable_blending: true\nuse_layerwise: true\nlocal_cpu: true\n'
                'max_local_cpu_size: 5\nblend_special_str: " # # "\n')
SYSTEM = "You are a very helpful assistant."
CHUNKS = ["Hello, how are you?" * 40, "Hello, what's up?" * 40, "Hey, how can i do" * 40]
FRESH = "Good morning, dear friend of the harbor." * 25
HITS = "vllm:kvblend_hit_segments_total"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plugin_dir(root: pathlib.Path) -> pathlib.Path:
    """A distribution whose ``vllm.general_plugins`` entry point registers the tokenizer mode in
    every vLLM process, as :mod:`cluster.vllm.plugin` will (see the report of issue 21)."""
    info = root / "kvblend_segment_tokenizer-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvblend-segment-tokenizer\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvblend_segment_tokenizer = cluster.vllm.segment_tokenizer:register\n")
    return root


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def lmcache_server(smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmcache-recipe")
    (tmp / "blending.yaml").write_text(LMCACHE_YAML)
    stats_path = tmp / "events.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    env.update(LMCACHE_CONFIG_FILE=str(tmp / "blending.yaml"), KVBLEND_RAY_ADDRESS="127.0.0.1:1",
               KVBLEND_DISK_PATH=str(tmp / "disk"), PATH=f"{BIN}:{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join(p for p in (str(_plugin_dir(tmp / "plugin")), env.get("PYTHONPATH")) if p))
    port = _free_port()
    ktc = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "cluster.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"stats_path": str(stats_path)}}
    argv = [str(BIN / "vllm"), "serve", smollm2_path, "--served-model-name", "model", "--port", str(port),
            "--enforce-eager", "--dtype", "float32", "--gpu-memory-utilization", "0.3", "--max-model-len", "4096",
            "--no-enable-prefix-caching", "--tokenizer-mode", "kvblend", "--kv-transfer-config", json.dumps(ktc)]
    with http_server(argv, env, tmp / "serve.log", port, ready_s=400) as (url, _proc):
        yield url, stats_path


def test_lmcache_blend_recipe_hits_every_chunk(lmcache_server, smollm2_path):
    import requests
    from openai import OpenAI
    from transformers import AutoTokenizer

    from cluster.vllm.events import read_events

    url, stats_path = lmcache_server
    client = OpenAI(base_url=url + "/v1", api_key="EMPTY")

    def complete(prompt) -> str:
        out = client.completions.create(model="model", prompt=prompt, max_tokens=10, temperature=0, top_p=0.95)
        return out.choices[0].text

    def hits() -> float:
        return _metric(requests.get(url + "/metrics", timeout=10).text, HITS)

    def stored() -> int:
        return sum(e.get("stored", 0) for e in read_events(str(stats_path)) if e["event"] == "store")

    def wait(check, what: str, timeout_s: float = 120.0) -> None:
        deadline = time.time() + timeout_s
        while not check():
            assert time.time() < deadline, f"timed out waiting for {what}"
            time.sleep(0.5)

    def hits_of(prompt, at_least: int) -> tuple[float, str]:
        before = hits()
        text = complete(prompt)
        # vLLM's stats loop publishes a step's counters a little later
        deadline = time.time() + 20
        while hits() - before < at_least and time.time() < deadline:
            time.sleep(0.5)
        return hits() - before, text

    # LMCache's precompute requests: "sys # # chunk1", "chunk2", "chunk3" (each stored as a chunk:
    # the system prompt and chunk1 from the first, the whole prompt from the others)
    for prompt in (SYSTEM + SEP + CHUNKS[0], CHUNKS[1], CHUNKS[2]):
        complete(prompt)
    wait(lambda: stored() >= 4, "the four precomputed segments to be stored")

    blend = SYSTEM + SEP + CHUNKS[1] + SEP + CHUNKS[0] + SEP + CHUNKS[2] + SEP + "Hello, how are you?"
    blend_hits, text = hits_of(blend, 4)
    assert blend_hits == 4, f"{blend_hits} hit segments (want the system prompt + 3 chunks)"
    assert isinstance(text, str) and "# #" not in text

    # the control: the same prompt as vLLM's hf mode tokenizes it, one string
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    whole_hits, _ = hits_of(tokenizer(blend)["input_ids"], 1)
    assert whole_hits < 4, f"whole-string ids hit {whole_hits} segments"
    print(f"hit segments: segment-wise {blend_hits:.0f}, whole-string {whole_hits:.0f}")

    # no system prompt: FRESH first (missed, stored as a chunk from the paged cache) ...
    before_stored = stored()
    complete(FRESH + SEP + CHUNKS[1] + SEP + "Which greeting?")
    wait(lambda: stored() > before_stored, "the first passage to be stored")
    # ... then reused in second position, with a stored chunk in first position
    reuse_hits, _ = hits_of(CHUNKS[1] + SEP + FRESH + SEP + CHUNKS[2] + SEP + "Which greeting?", 3)
    assert reuse_hits == 3, f"{reuse_hits} hit segments (want chunk2 first, the first passage, chunk3)"
