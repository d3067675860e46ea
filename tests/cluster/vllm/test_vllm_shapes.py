"""The connector's scheduler half on vLLM's own shapes, per version: ``SchedulerOutput``,
``NewRequestData``, ``CachedRequestData`` and ``Request`` are built from the extracts
(:mod:`tests.vllm.shapes`: 0.32 read from the installed package, 0.33 and 0.34 from the JSON
committed in ``tests/vllm``), their fields and attributes named there, not written by hand.

vLLM 0.34 changed two of them under the connector: ``CachedRequestData.resumed_req_ids`` is gone
(a resumed request is sent again in ``scheduled_new_reqs`` with its whole block list), and the
flag after which ``Scheduler.schedule`` throws a connector's hit away is
``Request.skip_reading_external_kv`` (a property over ``prefix_cache_hit_limit``), no longer
``skip_reading_prefix_cache``. The steps below are the ones each version sends for one blended
request: its async load, its first scheduled step, a decode step, a preemption and its resume.
"""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import pytest

from blend.segments import build_blend_prompt, chunk_token_ids
from cluster.config import load_config
from cluster.vllm.connector import KVBlendConnector
from cluster.vllm.events import EventLog, read_events
from cluster.vllm.metrics import Counters
from cluster.vllm.scheduler import KVBlendScheduler
from tests.factories import NAMESPACE, make_kv
from tests.vllm.shapes import VERSIONS, api, dataclass_of, request_of, zeroes_connector_hit
from tiers.keys import segment_key

pytestmark = pytest.mark.unit

BLOCK_SIZE = 16
PASSAGES = [
    "The river council of Arden met every spring near the old harbor to settle the rights of the "
    "fishermen, and its records fill eleven volumes kept in the town library.",
    "Lighthouse keepers on Varo island logged each ship that passed the strait; the logbooks name "
    "four hundred vessels between 1810 and 1850, most of them merchant brigs.",
]
#: what vLLM's Request.__init__ sets for a plain request (each version keeps those it has)
PLAIN = {"kv_transfer_params": None, "lora_request": None, "cache_salt": None, "mm_features": [],
         "prompt_embeds": None, "sampling_params": None, "pooling_params": None,
         "skip_reading_prefix_cache": False, "prefix_cache_hit_limit": None}
#: ... and for one with prompt logprobs from the first prompt token: 0.32/0.33 set
#: skip_reading_prefix_cache, 0.34 bounds the prefix cache hit at the first scored row (0)
PROMPT_LOGPROBS = {**PLAIN, "skip_reading_prefix_cache": True, "prefix_cache_hit_limit": 0}
OUR_VLLM_CODE = pathlib.Path(__file__).resolve().parents[3] / "cluster" / "vllm"


@pytest.fixture
def sched(tokenizer, client, events_path) -> KVBlendScheduler:
    """A scheduler half over ``client`` holding both passages (blends on the async path)."""
    for passage in PASSAGES:
        ids = chunk_token_ids(tokenizer, passage)
        client.put(segment_key(NAMESPACE, ids), make_kv(num_layers=1, num_tokens=len(ids), num_kv_heads=1,
                                                        head_dim=2), positions=list(range(len(ids))))
    config = load_config(environ={}, overrides={"min_tokens": 16, "chunk_size": 32})
    return KVBlendScheduler(config, client, namespace_digest=NAMESPACE, block_size=BLOCK_SIZE,
                            load_tokenizer=lambda: tokenizer, events=EventLog(events_path), counters=Counters())


@pytest.fixture
def prompt_ids(tokenizer) -> list[int]:
    ids, _ = build_blend_prompt(tokenizer, "Answer from the passages.", PASSAGES, "Question: which island?")
    return ids


class Blocks:
    """vLLM's ``KVCacheBlocks`` as ``update_state_after_alloc`` reads it (one KV cache group)."""

    def __init__(self, block_ids) -> None:
        self.block_ids = list(block_ids)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.block_ids,)


def claim(sched: KVBlendScheduler, request) -> tuple[int, bool]:
    """``KVBlendConnector.get_num_new_matched_tokens`` itself (the facade's prompt-logprob check,
    then the scheduler half), with no local prefix hit."""
    facade = SimpleNamespace(enabled=True, connector_scheduler=sched)
    return KVBlendConnector.get_num_new_matched_tokens(facade, request, 0)


def scheduler_output(version: str, new=(), cached=()):
    """vLLM ``version``'s ``SchedulerOutput`` of one step. ``new``: ``(request, block ids,
    computed, scheduled)``; ``cached``: ``(request id, new block ids or None, computed,
    scheduled, resumed)``; fields the version lacks (``resumed_req_ids``, ``all_token_ids``)
    are dropped by :func:`dataclass_of`."""
    new_reqs = [dataclass_of(version, "NewRequestData", {
        "req_id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids), "mm_features": [],
        "sampling_params": None, "pooling_params": None, "block_ids": (list(blocks),),
        "num_computed_tokens": done, "lora_request": None, "prefill_token_ids": list(r.prompt_token_ids)})
        for r, blocks, done, _ in new]
    cached_reqs = dataclass_of(version, "CachedRequestData", {
        "req_ids": [c[0] for c in cached], "resumed_req_ids": {c[0] for c in cached if c[4]},
        "new_token_ids": [[] for _ in cached], "all_token_ids": {},
        "new_block_ids": [None if c[1] is None else (list(c[1]),) for c in cached],
        "num_computed_tokens": [c[2] for c in cached], "num_output_tokens": [1 for _ in cached]})
    num_scheduled = {r.request_id: n for r, _, _, n in new} | {c[0]: c[3] for c in cached}
    return dataclass_of(version, "SchedulerOutput", {
        "scheduled_new_reqs": new_reqs, "scheduled_cached_reqs": cached_reqs,
        "num_scheduled_tokens": num_scheduled, "total_num_scheduled_tokens": sum(num_scheduled.values()),
        "scheduled_spec_decode_tokens": {}, "scheduled_encoder_inputs": {}, "num_common_prefix_blocks": [],
        "finished_req_ids": set(), "free_encoder_mm_hashes": []})


def slots(block_ids, start: int, end: int) -> list[int]:
    return [block_ids[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(start, end)]


@pytest.mark.parametrize("version", VERSIONS)
def test_build_connector_meta_follows_a_blended_request_through_each_versions_steps(version, sched, prompt_ids):
    request = request_of(version, {**PLAIN, "request_id": "r", "prompt_token_ids": prompt_ids})
    n = len(prompt_ids)
    claimed, is_async = claim(sched, request)
    assert claimed > 0 and is_async
    blocks = list(range(40, 40 + n // BLOCK_SIZE + 1))
    sched.update_state_after_alloc(request, Blocks(blocks), claimed)
    # the step after the allocation: the async load, over the allocated blocks
    (load,) = sched.build_connector_meta(scheduler_output(version)).loads
    assert (load.load_start, load.load_end) == (0, claimed)
    assert load.slot_mapping.tolist() == slots(blocks, 0, claimed)
    # loaded: vLLM schedules the rest of the prompt as a new request
    meta = sched.build_connector_meta(scheduler_output(version, new=[(request, blocks, claimed, n - claimed)]))
    assert meta.has_prefill and not meta.loads
    # a decode step: the request is a cached one
    meta = sched.build_connector_meta(scheduler_output(version, cached=[("r", None, n, 1, False)]))
    assert not meta.loads and not meta.has_prefill
    # preempted, asked again, given other blocks, loaded again, resumed
    assert claim(sched, request) == (claimed, True)
    moved = [b + 100 for b in blocks]
    sched.update_state_after_alloc(request, Blocks(moved), claimed)
    (load,) = sched.build_connector_meta(scheduler_output(version)).loads
    assert load.slot_mapping.tolist() == slots(moved, 0, claimed)
    if "resumed_req_ids" in {f["name"] for f in api(version)["classes"]["CachedRequestData"]["fields"]}:
        resume = scheduler_output(version, cached=[("r", moved, claimed, n - claimed, True)])   # 0.32, 0.33
    else:
        resume = scheduler_output(version, new=[(request, moved, claimed, n - claimed)])        # 0.34
    meta = sched.build_connector_meta(resume)
    assert meta.has_prefill and not meta.loads  # loaded once per admission, never twice
    sched.build_connector_meta(scheduler_output(version, cached=[("r", [999], n, 1, False)]))
    assert sched._requests["r"].block_ids == [*moved, 999]  # noqa: SLF001 - blocks follow vLLM's


@pytest.mark.parametrize("version", VERSIONS)
def test_prompt_logprob_requests_claim_nothing_under_each_versions_flag(version, sched, prompt_ids, events_path):
    """vLLM zeroes a connector's hit for prompt-logprob requests after asking; the connector
    must claim nothing for them in the first place (no blend planned for tokens vLLM refuses),
    whatever the version calls the flag."""
    plain = request_of(version, {**PLAIN, "request_id": "plain", "prompt_token_ids": prompt_ids})
    scored = request_of(version, {**PROMPT_LOGPROBS, "request_id": "scored", "prompt_token_ids": prompt_ids})
    assert not zeroes_connector_hit(version, plain)
    assert zeroes_connector_hit(version, scored), f"the test's prompt-logprob request is not one for vLLM {version}"
    assert claim(sched, plain)[0] > 0
    assert claim(sched, scored) == (0, False)
    events = [e for e in read_events(events_path) if e["request_id"] == "scored"]
    assert [(e["event"], e.get("path"), e.get("claimed_tokens")) for e in events] == [
        ("lookup", "none", None), ("claim", None, 0)]
    assert sched._counters.totals.get("ignored_overrides", 0) == 0  # noqa: SLF001 - not a user's override


def _reads(receivers: set[str]) -> tuple[set[str], set[str]]:
    """``(direct, tolerant)`` attribute names that ``cluster/vllm/*.py`` reads from variables
    named in ``receivers``: ``x.name`` is direct, ``getattr(x, "name", default)`` tolerant."""
    direct, tolerant = set(), set()
    for path in sorted(OUR_VLLM_CODE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in receivers:
                direct.add(node.attr)
            elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) == 3
                  and isinstance(node.args[0], ast.Name) and node.args[0].id in receivers
                  and isinstance(node.args[1], ast.Constant)):
                tolerant.add(node.args[1].value)
    return direct, tolerant


@pytest.mark.parametrize("receivers, classes", [
    ({"request"}, None),
    ({"scheduler_output"}, ("SchedulerOutput",)),
    ({"new_req"}, ("NewRequestData",)),
    ({"cached"}, ("CachedRequestData",)),
])
def test_what_the_connector_reads_directly_exists_in_every_version(receivers, classes):
    """A plain ``x.name`` read raises AttributeError on a version without ``name`` (0.34's
    ``cached.resumed_req_ids`` did); a field that some version lacks is read with
    ``getattr(x, name, default)``, and at least one version has it."""
    direct, tolerant = _reads(receivers)
    assert direct, f"no read of {receivers} found in {OUR_VLLM_CODE}: the test no longer sees the code"
    for version in VERSIONS:
        if classes is None:
            facts = api(version)["request"]
            names = set(facts["attributes"]) | set(facts["properties"]) | set(facts["methods"])
        else:
            names = {f["name"] for c in classes for f in api(version)["classes"][c]["fields"]}
        assert not direct - names, f"vLLM {version} lacks {sorted(direct - names)} that kvblend reads directly"
    every = [{*api(v)["request"]["attributes"], *api(v)["request"]["properties"]} if classes is None
             else {f["name"] for c in classes for f in api(v)["classes"][c]["fields"]} for v in VERSIONS]
    dead = [name for name in tolerant if not any(name in names for names in every)]
    assert not dead, f"kvblend reads {dead}, which no vLLM version has"


# ================================================================ may_load_async (vLLM 0.34)


def test_may_load_async_is_true_for_a_blend_prompt_before_its_lookup_and_exact_after(sched, prompt_ids, tokenizer,
                                                                                    monkeypatch):
    """vLLM 0.34 asks when the request enters the waiting queues, before any lookup: a prompt
    with chunk segments may blend asynchronously; once looked up, the plan answers. The
    segments found for the answer are the ones the lookup uses (the prompt is scanned once)."""
    import cluster.vllm.scheduler as scheduler_module

    scans = []
    real = scheduler_module.find_segments
    monkeypatch.setattr(scheduler_module, "find_segments", lambda *a, **k: scans.append(1) or real(*a, **k))
    request = request_of("0.34", {**PLAIN, "request_id": "r", "prompt_token_ids": prompt_ids})
    lookups = sched.client.counters["lookups"]
    assert sched.may_load_async(request) is True
    assert sched.client.counters["lookups"] == lookups  # no I/O
    assert claim(sched, request)[1] is True and len(scans) == 1
    assert sched.may_load_async(request) is True  # asked after its lookup: from its plan
    # the same prompt, nothing cached: may (a false positive) before the lookup, no after
    cold = request_of("0.34", {**PLAIN, "request_id": "cold", "prompt_token_ids": prompt_ids})
    sched.client.delete(sched.client.tier.keys())
    assert sched.may_load_async(cold) is True
    assert claim(sched, cold) == (0, False) and sched.may_load_async(cold) is False
    # aborted while waiting, never looked up: its segments are dropped with it
    aborted = request_of("0.34", {**PLAIN, "request_id": "aborted", "prompt_token_ids": prompt_ids})
    assert sched.may_load_async(aborted) and "aborted" in sched._found_spans  # noqa: SLF001
    sched.request_finished(aborted, [])
    assert "aborted" not in sched._found_spans  # noqa: SLF001


@pytest.mark.parametrize("case", ["no separator", "prompt logprobs", "load_async off", "LoRA", "prefix engine"])
def test_may_load_async_is_false_where_no_async_blend_can_come(case, tokenizer, client, events_path, prompt_ids):
    config = load_config(environ={}, overrides={"min_tokens": 16, "chunk_size": 32,
                                                **({"engine_type": "prefix"} if case == "prefix engine" else {})})
    sched = KVBlendScheduler(config, client, namespace_digest=NAMESPACE, block_size=BLOCK_SIZE,
                             load_tokenizer=lambda: tokenizer, load_async=case != "load_async off",
                             events=EventLog(events_path), counters=Counters())
    values = {**PLAIN, "request_id": "r", "prompt_token_ids": prompt_ids}
    if case == "no separator":
        values["prompt_token_ids"] = chunk_token_ids(tokenizer, " ".join(PASSAGES))
    elif case == "prompt logprobs":
        values.update(PROMPT_LOGPROBS)
    elif case == "LoRA":
        values["lora_request"] = SimpleNamespace(lora_name="a", lora_path="")
    request = request_of("0.34", values)
    assert sched.may_load_async(request) is False
    assert claim(sched, request)[1] is False  # and the lookup agrees
