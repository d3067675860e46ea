"""Issue 19, item 3: KV never crosses a LoRA adapter or a ``cache_salt``, and requests whose KV
depends on more than their token ids (multimodal inputs, prompt embeddings) are never cached.

The scheduler half over a machine-local client with fake requests (as ``test_scheduler``): a
chunk stored under one tenant is a miss for every other tenant, in the blend and in the prefix
path; the keys of the base model without a salt are the keys from before tenants existed.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from blend.segments import build_blend_prompt, chunk_token_ids
from cluster.cache.local import LocalCacheClient
from cluster.config import load_config
from cluster.vllm.events import EventLog, read_events
from cluster.vllm.metrics import Counters
from cluster.vllm.scheduler import KVBlendScheduler
from cluster.vllm.tenant import adapter_fingerprint, request_tenant
from tests.cluster.vllm.helpers import passage, stand_in_vllm_config
from tests.factories import NAMESPACE, make_kv
from tiers.keys import prefix_keys, segment_key

pytestmark = pytest.mark.unit

PASSAGES = [passage(71, 3), passage(72, 3)]


@dataclass
class Req:
    """What the scheduler half reads of vLLM's ``Request``, tenant fields included."""

    request_id: str
    prompt_token_ids: list[int]
    lora_request: object = None
    cache_salt: str | None = None
    mm_features: list | None = None
    prompt_embeds: object = None
    kv_transfer_params: dict | None = None


def lora(tmp_path, name: str, weights: bytes) -> SimpleNamespace:
    """vLLM's ``LoRARequest`` of an adapter folder holding ``weights``."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=str(folder))


@pytest.fixture
def setup(tokenizer, tmp_path):
    client = LocalCacheClient()
    events = str(tmp_path / "events.jsonl")
    config = load_config(environ={}, overrides={"min_tokens": 16, "chunk_size": 32})
    sched = KVBlendScheduler(config, client, namespace_digest=NAMESPACE, block_size=16,
                             load_tokenizer=lambda: tokenizer, events=EventLog(events), counters=Counters())
    ids, _ = build_blend_prompt(tokenizer, "Answer from the passages.", PASSAGES, "Question: which island?")
    return sched, client, ids, events


def store_as(client, tokenizer, tenant: str) -> None:
    """The passages' chunks as a request of ``tenant`` would have stored them."""
    for text in PASSAGES:
        ids = chunk_token_ids(tokenizer, text)
        client.put(segment_key(NAMESPACE, ids, tenant), make_kv(num_layers=1, num_tokens=len(ids),
                                                                   num_kv_heads=1, head_dim=2),
                   positions=list(range(len(ids))))


def test_base_keys_are_unchanged_and_every_tenant_gets_its_own():
    ids = [5, 6, 7, 8]
    legacy = hashlib.blake2b(b"".join(i.to_bytes(8, "little") for i in ids), digest_size=16,
                             person=b"kvblend-seg").hexdigest()
    assert segment_key(NAMESPACE, ids).content == legacy  # objects stored before stay valid
    tenants = ["", "lora=1:a:x", "lora=1:b:x", "lora=1:a:y", "salt=2:s1", "salt=2:s2"]
    assert len({segment_key(NAMESPACE, ids, t) for t in tenants}) == len(tenants)
    assert len({tuple(prefix_keys(NAMESPACE, ids * 16, 32, t)) for t in tenants}) == len(tenants)


def test_tenant_names_the_adapter_its_weights_and_the_salt(tmp_path):
    a = lora(tmp_path, "a", b"\x01" * 4096)
    assert request_tenant(Req("r", [1])) == ("", None)
    t_a, _ = request_tenant(Req("r", [1], lora_request=a))
    assert t_a.startswith("lora=1:a:") and t_a.endswith(adapter_fingerprint(a.lora_path))
    t_salted, _ = request_tenant(Req("r", [1], lora_request=a, cache_salt="user-7"))
    assert t_salted != t_a and t_salted.endswith("salt=6:user-7")
    # The same name with retrained weights is another tenant; the same weights elsewhere are not.
    (tmp_path / "v2").mkdir()
    retrained = lora(tmp_path / "v2", "a", b"\x01" * 4095 + b"\x02")
    assert request_tenant(Req("r", [1], lora_request=retrained))[0] != t_a
    (tmp_path / "v3").mkdir()
    assert request_tenant(Req("r", [1], lora_request=lora(tmp_path / "v3", "a", b"\x01" * 4096)))[0] == t_a
    assert request_tenant(Req("r", [1], mm_features=[object()])) == ("", "multimodal inputs")
    assert request_tenant(Req("r", [1], prompt_embeds=object())) == ("", "prompt embeddings")
    # A file that vanishes between listing and reading: not cached, never an exception.
    gone = lora(tmp_path, "gone", b"\x03" * 64)
    os.symlink(str(tmp_path / "missing"), os.path.join(gone.lora_path, "dangling.bin"))
    assert request_tenant(Req("r", [1], lora_request=gone)) == ("", "an unreadable LoRA adapter")


def test_chunks_stored_under_one_adapter_never_serve_another(setup, tokenizer, tmp_path, caplog):
    """A request under an adapter takes the prefix path (its blend segments would need the
    adapter in our own prefill, tenant.prefix_only): its prefix chunks, keyed by its tenant,
    hit for that adapter only; segments stored under the adapter's keys are not even looked up."""
    sched, client, ids, events = setup
    a, b = lora(tmp_path, "a", b"\x01" * 4096), lora(tmp_path, "b", b"\x02" * 4096)
    tenant_a, tenant_b = (request_tenant(Req("x", ids, lora_request=x))[0] for x in (a, b))
    store_as(client, tokenizer, tenant_a)
    for key in prefix_keys(NAMESPACE, ids, 32, tenant_a):
        client.put(key, make_kv(num_layers=1, num_tokens=32, num_kv_heads=1, head_dim=2))
    full_chunks = (len(ids) - 1) // 32
    assert sched.get_num_new_matched_tokens(Req("under-a", ids, lora_request=a), 0)[0] == 32 * full_chunks
    assert sched.get_num_new_matched_tokens(Req("under-b", ids, lora_request=b), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(Req("base", ids), 0) == (0, False)
    lookups = {e["request_id"]: e for e in read_events(events) if e["event"] == "lookup"}
    assert lookups["under-a"]["path"] == "prefix" and "num_prefix_chunks" in lookups["under-b"]  # the prefix path
    assert lookups["under-a"]["num_prefix_hits"] == full_chunks and lookups["under-b"]["num_prefix_hits"] == 0
    assert lookups["base"]["num_hit_segments"] == 0  # the base model blends, and a's segments are not its
    # What b misses it stores under b's prefix keys, never under a's or the base model's.
    stored = [k for k, _, _ in sched._requests["under-b"].store_prefix]
    assert stored and set(stored) <= set(prefix_keys(NAMESPACE, ids, 32, tenant_b))
    assert sum("LoRA adapter reuse prefix chunks only" in r.getMessage() for r in caplog.records) == 1


def test_cache_salt_separates_requests_in_both_paths(setup, tokenizer):
    sched, client, ids, events = setup
    store_as(client, tokenizer, request_tenant(Req("x", ids, cache_salt="alice"))[0])
    assert sched.get_num_new_matched_tokens(Req("r1", ids, cache_salt="alice"), 0)[0] > 0
    assert sched.get_num_new_matched_tokens(Req("r2", ids, cache_salt="bob"), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(Req("r3", ids), 0) == (0, False)
    # The prefix path (no separators) keys chunks by tenant as well.
    plain = list(range(100, 180))
    for key in prefix_keys(NAMESPACE, plain, 32, request_tenant(Req("x", plain, cache_salt="alice"))[0]):
        client.put(key, make_kv(num_layers=1, num_tokens=32, num_kv_heads=1, head_dim=2))
    assert sched.get_num_new_matched_tokens(Req("r4", plain, cache_salt="alice"), 0)[0] == 64
    assert sched.get_num_new_matched_tokens(Req("r5", plain, cache_salt="bob"), 0) == (0, False)
    assert all("alice" not in line and "bob" not in line for line in open(events))  # salts stay out of logs


@pytest.mark.parametrize("extra", [{"mm_features": [object()]}, {"prompt_embeds": object()}])
def test_multimodal_and_embedding_requests_are_neither_loaded_nor_stored(setup, tokenizer, extra, caplog):
    sched, client, ids, events = setup
    store_as(client, tokenizer, "")
    lookups = client.counters["lookups"]
    assert sched.get_num_new_matched_tokens(Req("mm", ids, **extra), 0) == (0, False)
    assert sched._requests["mm"].store_segments == [] and client.counters["lookups"] == lookups
    assert sched._counters.totals["uncacheable_requests"] == 1
    (event,) = [e for e in read_events(events) if e["event"] == "lookup"]
    assert event["uncacheable"] in ("multimodal inputs", "prompt embeddings")
    assert sum("neither loaded nor stored" in r.message for r in caplog.records) == 1
    sched.get_num_new_matched_tokens(Req("mm2", ids, **extra), 0)
    assert sum("neither loaded nor stored" in r.message for r in caplog.records) == 1  # once


def test_pipeline_parallelism_leaves_the_connector_idle(tmp_path, monkeypatch, caplog):
    """A chunk holds every layer; a pipeline stage holds some: with pipeline_parallel_size > 1
    the connector neither loads nor stores, and says so once at start-up."""
    import json
    import logging

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from cluster.vllm.connector import KVBlendConnector

    for var in ("KVBLEND_CONFIG", "LMCACHE_CONFIG_FILE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 2}))
    vllm_config = stand_in_vllm_config(tmp_path, pp=2)
    with caplog.at_level(logging.WARNING):
        connector = KVBlendConnector(vllm_config, KVConnectorRole.SCHEDULER)
    assert not connector.enabled and connector.client is None
    assert sum("pipeline_parallel_size=2" in r.getMessage() for r in caplog.records) == 1
