"""``vllm serve Org/Name`` — a Hugging Face Hub id, served from the local HF cache, no Hub — with
the connector, and ``kvblend ingest --model Org/Name`` filling the cache it reads (issue 18).

The Hub cache is built on disk from the bundled SmolLM2 (:func:`tests.cluster.hf_cache.hub_cache`).
Two engine starts (each ~1 min), both with ``HF_HUB_OFFLINE=1`` (vLLM then hands the connector
the snapshot folder): plain, and with ``--hf-overrides``; each time the passages ``kvblend
ingest`` stored under the same options are hit, and the namespace digest ingest printed is the
one the connector wrote in its ``start`` event.

Online with the Hub unreachable (``HF_HUB_OFFLINE`` unset, ``HF_ENDPOINT`` refusing connections)
vLLM 0.32 itself does not start for a Hub id: ``get_config`` asks
``file_or_path_exists(model, "hf_quant_config.json")``, which lists the repo's files on the Hub
when the file is not in the cache and re-raises the ``ConnectError`` (after ~50 s of retries;
only ``OfflineModeIsEnabled`` is caught, ``vllm/transformers_utils/repo_utils.py``);
``get_pooling_config`` does the same for ``modules.json``. So the online path is tested as far as
it is ours: the connector built with ``model_config.model = "Org/Name"`` in a process with
``HF_HUB_OFFLINE`` unset and the Hub unreachable gets the same digest, at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from cluster.vllm.events import read_events
from cluster.workloads.services import free_port
from tests.cluster.hf_cache import REPO, hub_cache
from tests.cluster.vllm.helpers import NO_RAY, SYSTEM, passage
from tests.serving import http_server

pytestmark = pytest.mark.engine

BIN = pathlib.Path(sys.executable).parent
ROOT = pathlib.Path(__file__).resolve().parents[3]
OVERRIDES = '{"max_position_embeddings": 4096}'  # changes the config, not the KV
QUESTION = "Question: Which passage mentions a canal? Answer:"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, smollm2_path):
    """``(root, passages, corpus path)``: the HF cache under ``root/hub``, the kvblend cache dir
    and disk tier under ``root`` (nothing of the user's)."""
    root = tmp_path_factory.mktemp("hub-model")
    hub_cache(root / "hub", smollm2_path)
    passages = [passage(1800 + i, num_sentences=8) for i in range(3)]
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in passages))
    return root, passages, corpus


def _env(root: pathlib.Path, *, online: bool = False) -> dict:
    env = dict(os.environ)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "KVBLEND_CONFIG"):
        env.pop(var, None)  # a user's shell: vLLM sizes its KV by --gpu-memory-utilization
    env.update(HF_HOME=str(root / "hf-home"), HF_HUB_CACHE=str(root / "hub"),
               KVBLEND_CACHE_DIR=str(root / "kvblend"), KVBLEND_DISK_PATH=str(root / "disk"),
               KVBLEND_RAY_ADDRESS=NO_RAY,  # no Ray: every process uses the machine-local disk cache
               PATH=f"{BIN}:{env.get('PATH', '')}")
    if online:
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # the Hub: connection refused
    else:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def ingest(root, corpus, *extra: str) -> str:
    """``kvblend ingest --model Org/Name``; returns the namespace digest it printed."""
    r = subprocess.run([str(BIN / "kvblend"), "ingest", "--data", str(corpus), "--model", REPO,
                        "--dtype", "float32", *extra], env=_env(root), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    found = re.search(r"^namespace ([0-9a-f]{16}) \(model Org/Name,", r.stdout, re.M)
    assert found, r.stdout
    return found.group(1)


@contextlib.contextmanager
def serve(root, stats_path, *extra: str):
    """``vllm serve Org/Name`` on CPU in float32 with the connector; yields its URL."""

    port = free_port()
    ktc = {"kv_connector": "KVBlendConnector", "kv_connector_module_path": "cluster.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"stats_path": str(stats_path), "min_tokens": 32}}
    log_path = root / f"serve-{port}.log"
    argv = [str(BIN / "vllm"), "serve", REPO, "--dtype", "float32", "--gpu-memory-utilization", "0.3",
            "--max-model-len", "2048", "--enforce-eager", "--port", str(port),
            "--kv-transfer-config", json.dumps(ktc), *extra]
    with http_server(argv, _env(root), log_path, port) as (url, _proc):
        yield url


def ask_blend(url: str, tokenizer, passages) -> None:
    """One completion of ``[BOS] system ⟨sep⟩ p1 ⟨sep⟩ p2 ⟨sep⟩ p3 ⟨sep⟩ question`` as token ids."""
    import requests

    from blend.segments import build_blend_prompt

    ids, _ = build_blend_prompt(tokenizer, SYSTEM, passages, QUESTION)
    model = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    resp = requests.post(url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": ids, "max_tokens": 4, "temperature": 0.0})
    assert resp.status_code == 200, resp.text


def served_namespace_and_lookup(stats_path) -> tuple[set[str], dict]:
    events = read_events(str(stats_path))
    starts = {e["namespace"] for e in events if e["event"] == "start"}
    # the system prompt (a chunk too, not ingested) and the 3 passages
    lookups = [e for e in events if e["event"] == "lookup" and e.get("num_segments") == 4]
    assert lookups, events
    return starts, lookups[-1]


@pytest.fixture(scope="module")
def ingested(hub) -> dict[str, str]:
    """Namespace digests ``kvblend ingest --model Org/Name`` printed, by ``--hf-overrides`` value
    (``""``: none); the passages are stored under each."""
    root, _, corpus = hub
    return {"": ingest(root, corpus), OVERRIDES: ingest(root, corpus, "--hf-overrides", OVERRIDES)}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_ingest_digests_differ_with_overrides_and_repeat_without(hub, ingested):
    root, _, corpus = hub
    assert ingested[""] != ingested[OVERRIDES]
    assert ingest(root, corpus) == ingested[""]


@pytest.mark.parametrize("overrides", ["", OVERRIDES], ids=["plain", "hf-overrides"])
def test_vllm_serve_of_a_hub_id_hits_what_ingest_stored(hub, ingested, tokenizer, overrides):
    root, passages, _ = hub
    stats = root / f"stats-{len(overrides)}.jsonl"
    with serve(root, stats, *(("--hf-overrides", overrides) if overrides else ())) as url:
        ask_blend(url, tokenizer, passages)
    starts, lookup = served_namespace_and_lookup(stats)
    assert starts == {ingested[overrides]}  # scheduler and worker: ingest's namespace
    assert lookup["num_hit_segments"] == 3, lookup  # the passages ingest stored


_CONNECTOR = """
import json, sys, time
t0 = time.perf_counter()
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from cluster.vllm.connector import KVBlendConnector
from tests.cluster.vllm.helpers import stand_in_vllm_config
cfg = stand_in_vllm_config("Org/Name")
cfg.model_config.hf_overrides = json.loads(sys.argv[1]) if sys.argv[1] else {}
cfg.model_config.revision = None
t1 = time.perf_counter()
connector = KVBlendConnector(cfg, KVConnectorRole.SCHEDULER)
tok = connector._load_tokenizer()
print(json.dumps({"digest": connector.namespace_digest, "model_id": connector.namespace.model_id,
                  "vocab": len(tok), "seconds": time.perf_counter() - t1}))
"""


@pytest.mark.parametrize("overrides", ["", OVERRIDES], ids=["plain", "hf-overrides"])
def test_online_with_the_hub_unreachable_the_connector_gets_ingests_namespace(hub, ingested, overrides):
    """``model_config.model == "Org/Name"`` (what vLLM keeps when HF_HUB_OFFLINE is unset): the
    connector resolves it from the cache without a Hub call (no retries: seconds, not minutes)."""
    root = hub[0]
    r = subprocess.run([sys.executable, "-c", _CONNECTOR, overrides], env=_env(root, online=True), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["digest"] == ingested[overrides] and got["model_id"] == REPO
    assert got["vocab"] == 49152 and got["seconds"] < 20, got
