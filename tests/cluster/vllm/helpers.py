"""Helpers of the vLLM tests: deterministic passages, greedy generation through an engine, the
connector's events, a one-node Ray cache, and the oracle comparison (a blended output
against vLLM's own full prefill of the same prompt). Fixtures are in ``conftest.py``."""

from __future__ import annotations

import contextlib
import math
import random
import time
import uuid

#: Ray address nobody listens on: the connector falls back to its process-local cache at once.
NO_RAY = "127.0.0.1:1"


_WORDS = ("river mountain council harbor festival engineer library painter treaty railway "
          "orchard senator museum glacier village composer fortress island merchant bridge "
          "monastery telescope vineyard regiment cathedral canal novelist parliament lighthouse "
          "desert").split()


def stand_in_vllm_config(model_dir, *, extra: dict | None = None, cache_dtype: str = "auto",
                         tp: int = 1, pp: int = 1):
    """What :class:`cluster.vllm.connector.KVBlendConnector`'s constructor reads of a
    ``VllmConfig``, for building a connector without an engine (``model_dir`` holds a
    ``config.json``)."""
    from types import SimpleNamespace as NS

    return NS(kv_transfer_config=NS(kv_connector_extra_config=dict(extra or {}), kv_load_failure_policy="recompute"),
              model_config=NS(model=str(model_dir), dtype="float32", tokenizer=None),
              cache_config=NS(cache_dtype=cache_dtype, block_size=16),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp))


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


def generate(llm, token_ids, params: dict | None = None, max_tokens: int = 6, logprobs: int = 5):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)
    if params is not None:
        sp.extra_args = {"kv_transfer_params": params}
    out = llm.generate([{"prompt_token_ids": list(token_ids)}], sp, use_tqdm=False)[0]
    settle(llm)  # the connector's stores run in later engine steps
    return out


def settle(llm) -> int:
    from cluster.vllm.offline import settle as _settle

    return _settle(llm)


def events(stats_path: str, request_id: str, event: str | None = None) -> list[dict]:
    from cluster.vllm.events import read_events

    # vLLM's engine adds a random suffix to the front end's request id ("0" -> "0-1a2b3c4d")
    return [e for e in read_events(stats_path)
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
              "disk_size_gib": 0.5, "call_timeout_s": 10.0, "load_timeout_s": 10.0, **overrides}
    ray.init(address=cluster.address, namespace="kvblend-vllm-test", log_to_driver=False)
    try:
        yield config, start_shards(load_config(environ={}, overrides=config))
    finally:
        ray.shutdown()
        cluster.shutdown()


SYSTEM = "You are a helpful assistant. Answer the question using the passages."


FULL = {"kvblend_load": False}


def request_id_of(out) -> str:
    return out.request_id


def assert_matches_full(out, ref, atol=2e-3):
    """First-token logprobs equal within float32 tolerance; greedy tokens equal while the
    oracle's top-2 margin is clear (> 0.05 nats)."""
    first, first_ref = out.outputs[0].logprobs[0], ref.outputs[0].logprobs[0]
    assert set(first) == set(first_ref)
    for tok, lp in first_ref.items():
        assert math.isclose(first[tok].logprob, lp.logprob, abs_tol=atol), (tok, first[tok], lp)
    for step, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref.outputs[0].token_ids, strict=False)):
        top = sorted((lp.logprob for lp in ref.outputs[0].logprobs[step].values()), reverse=True)
        if len(top) > 1 and top[0] - top[1] < 0.05:
            break
        assert a == b, f"greedy token {step} differs: {a} vs {b}"


def generate_and_store(llm, stats_path, ids, params=None):
    """Generate greedily from ``ids`` and wait for the connector to store the request's chunks;
    returns ``(output, store event)``."""
    out = generate(llm, ids, params)
    store = wait_stored(stats_path, request_id_of(out))
    assert store["error"] is None
    return out, store


def wait_restarted(config, name: str, old_pid: int, timeout_s: float = 90.0) -> None:
    """Wait until shard ``name`` answers ``ready()`` from a process other than ``old_pid``
    (Ray restarted it); AssertionError after ``timeout_s``."""
    import ray

    from cluster.cache.lifecycle import get_shard

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ray.get(get_shard(name, config.cluster.ray_namespace).ready.remote(), timeout=5)["pid"] != old_pid:
                return
        except Exception:  # noqa: BLE001 - still restarting
            pass
        time.sleep(0.5)
    raise AssertionError(f"shard {name} did not restart")


def plan_spans(tokenizer, ids, spans):
    """The spans the connector's scheduler plans for ``ids`` (``spans`` from
    :func:`blend.segments.build_blend_prompt` or ``find_segments``): the first segment, after
    a BOS the tokenizer adds, is a chunk too (:func:`blend.segments.first_segment_as_chunk`)."""
    from blend.segments import first_segment_as_chunk, special_tokens_around

    return first_segment_as_chunk(spans, ids, special_tokens_around(tokenizer))


def chunk_tokens_of(tokenizer, ids, spans) -> int:
    """Tokens of the chunks the connector plans for ``ids`` (the first segment included)."""
    return sum(e - s for kind, s, e in plan_spans(tokenizer, ids, spans) if kind == "chunk")


def use_client(llm, client, monkeypatch) -> None:
    """Route the in-process engine's scheduler lookups and worker reads and stores through
    ``client``; no gpu tier (every layer is read from the client)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker
    worker._engine_for_worker()  # builds the worker's source
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    for obj in (worker, scheduler, worker._source, worker.stores):
        monkeypatch.setattr(obj, "client", client)
    monkeypatch.setattr(worker._source, "reader", client)  # the CPU worker reads the client directly
    monkeypatch.setattr(worker._source, "gpu", None)
