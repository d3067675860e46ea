"""The connector loaded by its short name through the ``kvblend`` general plugin, in vLLM's
multiprocess engine, with vLLM's prefix caching on (the byte-identical repeat of
shared/cases/full-hit-reordered.md is then served by vLLM's prefix cache, counters say so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cluster.vllm.helpers import events, one_node_ray_cache

#: plugin_run.py, run as a module from the repository root (a fresh process: stock vLLM).
PLUGIN_RUN = "tests.cluster.vllm.plugin_run"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]  # each engine run's guard: 900 s


@pytest.fixture(scope="module")
def plugin_run(smollm2_path, tmp_path_factory):
    stats = str(tmp_path_factory.mktemp("plugin") / "stats.jsonl")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", PLUGIN_RUN,
                           smollm2_path, stats], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):]), stats


def test_short_name_loads_the_connector_in_both_roles(plugin_run):
    """Scheduler role in the engine-core process, worker role in the worker process; the
    segments are found, the cold request's chunks are stored by the worker.

    Without a reachable Ray cache the two processes do not share a cache, so the reordered
    request cannot hit here (the Ray-backed path is what shares chunks across processes)."""
    result, stats = plugin_run
    cold, blended, repeat = result["outputs"]
    lookups = [events(stats, o["request_id"], "lookup")[0] for o in (cold, blended)]
    assert [lk["num_segments"] for lk in lookups] == [4, 4]  # the system prompt and 3 passages
    stores = events(stats, cold["request_id"], "store")
    # the passages computed canonically, the system prompt gathered from vLLM's paged KV
    assert sum(st["stored"] for st in stores) == 4 and all(st["error"] is None for st in stores)
    assert stores[0]["pid"] != lookups[0]["pid"] != os.getpid()  # three processes, one stats file
    assert len(blended["token_ids"]) >= 1


def test_repeat_is_served_by_vllm_prefix_cache(plugin_run):
    result, stats = plugin_run
    _, blended, repeat = result["outputs"]
    claim = events(stats, repeat["request_id"], "claim")[-1]
    # vLLM's prefix cache holds the previous request's full blocks: the connector claims
    # nothing before them (counters say the repeat was served by vLLM's prefix cache)
    block_size = 128  # vLLM CPU default
    assert claim["local_computed_tokens"] == (result["num_tokens"] - 1) // block_size * block_size
    assert claim["claimed_tokens"] == max(0, claim["claim_end"] - claim["local_computed_tokens"])
    assert repeat["token_ids"] == blended["token_ids"]


@pytest.fixture(scope="module")
def ray_cache(tmp_path_factory):
    """A one-node Ray cluster with kvblend shards (small object store); config overrides."""
    with one_node_ray_cache(tmp_path_factory.mktemp("raycache")) as (overrides, _):
        yield overrides


def _plugin_run(smollm2_path, stats: str, ray_cache: dict, **env_extra) -> list[dict]:
    """``plugin_run.py`` over the Ray cache in a fresh process; its outputs."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1", **env_extra)
    proc = subprocess.run([sys.executable, "-m", PLUGIN_RUN,
                           smollm2_path, stats, json.dumps(ray_cache)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])["outputs"]


@pytest.fixture(scope="module")
def ray_writer_run(smollm2_path, tmp_path_factory, ray_cache):
    """Engine A over the Ray cache (cold, reordered, repeat), exited: ``(outputs, stats path)``.
    A fixture, so the test of engine B that reads what A stored needs no other test to run
    first."""
    stats = str(tmp_path_factory.mktemp("plugin_ray") / "stats.jsonl")
    return _plugin_run(smollm2_path, stats, ray_cache), stats


def test_ray_cache_shared_by_scheduler_and_worker_processes(ray_writer_run):
    """With the Ray-hosted cache the worker's stores are hits for the engine-core process's
    lookups: the reordered request blends every segment."""
    (cold, blended, _), stats = ray_writer_run
    assert sum(st["stored"] for st in events(stats, cold["request_id"], "store")) == 4
    lookup = events(stats, blended["request_id"], "lookup")[0]
    assert (lookup["path"], lookup["num_hit_segments"]) == ("blend", 4)  # the system prompt and 3 passages
    load = events(stats, blended["request_id"], "load")[0]
    assert not load["fallback"] and load["num_hit_segments"] == 4


def test_second_engine_hits_chunks_stored_by_the_first(smollm2_path, tmp_path_factory, ray_cache,
                                                        ray_writer_run):
    """Issue 6 test 3: engine B, another process started after engine A exited (A's connector
    flushed its stores at shutdown), blends every segment from the Ray-hosted cache."""
    stats = str(tmp_path_factory.mktemp("plugin_ray_b") / "stats.jsonl")
    (blended,) = _plugin_run(smollm2_path, stats, ray_cache, PLUGIN_RUN_PHASE="reader")
    lookup = events(stats, blended["request_id"], "lookup")[0]
    assert (lookup["path"], lookup["num_hit_segments"]) == ("blend", 4)
    assert not events(stats, blended["request_id"], "store")  # nothing new to store
    load = events(stats, blended["request_id"], "load")[0]
    assert not load["fallback"] and load["num_hit_segments"] == 4
