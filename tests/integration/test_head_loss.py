"""A lost Ray head never ends vLLM (issue 18): `vllm serve` with the connector keeps serving
(full prefill) while the head is gone for longer than Ray's GCS reconnect timeout, and its
chunks hit again once the head and the shards are back (issue 35: the connector is pinned to
``host:port`` and `kvblend server --port` starts the head again on that same address).

Real parts: a Ray head and its shards started by `kvblend server --address local --port PORT`
on a private port and temp dir, passages stored by `kvblend ingest`, `vllm serve` on the CPU.
Every Ray process of this test gets ``RAY_gcs_rpc_server_reconnect_timeout_s=5`` (the default
is 60 s): a Ray driver inside vLLM's engine (``ray_client=driver``) would be ended by Ray
5 s after the head went away; with the cache agent only the agent is.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import time

import pytest

from tests.integration.test_readme_lines import BIN, _env, _metric
from tests.serving import http_server

pytestmark = pytest.mark.integration

GCS_TIMEOUT_S = 5
HANG_S = 300  # the only timing: a hang guard


def _kvblend_server(port: int, temp_dir: str, env: dict) -> None:
    """`kvblend server` starting a head on ``port`` (its fixed address) with its shards."""
    from cluster.workloads.services import free_port

    r = subprocess.run([str(BIN / "kvblend"), "server", "--address", "local", "--port", str(port),
                        "--temp-dir", temp_dir, "--no-dashboard", "--ray-client-server-port", str(free_port())],
                       env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["address"].endswith(f":{port}")


def _kill_head(temp_dir: str) -> int:
    """SIGKILL every process of the Ray node started with ``temp_dir`` (GCS, raylet, the
    shard workers under it): the head is lost, not stopped."""
    import psutil

    from cluster.workloads.local_ray import ray_node_processes

    victims = ray_node_processes(temp_dir)
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(victims)


def _engine_pids(serve: subprocess.Popen) -> set[int]:
    """Pids of vLLM's processes (API server and engine core), not the cache agents."""
    import psutil

    root = psutil.Process(serve.pid)
    procs = [root, *root.children(recursive=True)]
    return {p.pid for p in procs if "cluster.cache.agent" not in " ".join(p.cmdline())}


def test_vllm_outlives_a_lost_ray_head(smollm2_path, tmp_path):
    import requests

    from cluster.workloads.qa import load_examples, resolve_dataset
    from cluster.workloads.services import free_port

    ray_port, http_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvbhl-", dir="/tmp")  # short: Ray's socket paths
    env = _env()
    env.update({"RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_TIMEOUT_S), "RAY_ADDRESS": f"127.0.0.1:{ray_port}",
                "KVBLEND_RAY_ADDRESS": f"127.0.0.1:{ray_port}", "KVBLEND_RAY_NAMESPACE": "kvblend-headloss",
                "KVBLEND_DISK_PATH": str(tmp_path / "disk"), "KVBLEND_DISK_SIZE_GIB": "1",
                "KVBLEND_HOST_SIZE_GIB": "0.2", "KVBLEND_LOCAL_FALLBACK": "off", "KVBLEND_NODE_NAME": "headloss",
                "KVBLEND_OBJECT_KEY_FILE": str(tmp_path / "object-key")})  # created by `kvblend server`
    stack = contextlib.ExitStack()  # the vLLM server, once started
    try:
        _kvblend_server(ray_port, temp_dir, env)
        ex = load_examples(resolve_dataset("wikimqa"), limit=1)[0]
        passages = list(ex.passages[:3])
        corpus = tmp_path / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(p) + "\n" for p in passages))
        r = subprocess.run([str(BIN / "kvblend"), "ingest", "--data", str(corpus)], env=env,
                           capture_output=True, text=True, timeout=HANG_S)
        assert r.returncode == 0 and "ingested 3 passages" in r.stdout, r.stdout + r.stderr

        log_path = tmp_path / "serve.log"
        argv = [str(BIN / "vllm"), "serve", smollm2_path, "--served-model-name", "model", "--enforce-eager",
                "--port", str(http_port), "--dtype", "float32", "--gpu-memory-utilization", "0.3",
                "--kv-transfer-config", json.dumps({
                    "kv_connector": "KVBlendConnector", "kv_connector_module_path": "cluster.connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute"})]
        url, serve = stack.enter_context(http_server(argv, env, log_path, http_port, ready_s=HANG_S))

        sep = "\n# #\n"

        def hits() -> float:
            return _metric(requests.get(url + "/metrics", timeout=10).text, "vllm:kvblend_hit_segments_total")

        def ask(order, query) -> tuple[float, str]:
            before = hits()
            user = sep + sep.join(passages[i] for i in order) + sep + f"Question: {query}"
            resp = requests.post(url + "/v1/chat/completions", timeout=HANG_S, json={
                "model": "model", "max_tokens": 6, "temperature": 0.0,
                "messages": [{"role": "user", "content": user}]})
            assert resp.status_code == 200, resp.text
            time.sleep(1.5)  # vLLM's stats loop publishes the step's counters (not a timing assertion)
            return hits() - before, resp.json()["choices"][0]["message"]["content"]

        got, _ = ask([0, 1, 2], ex.question)
        assert got == 3, "the ingested passages hit before the head is lost"
        pids = _engine_pids(serve)
        time.sleep(2)  # the shard's write-down of host chunks to its disk directory

        assert _kill_head(temp_dir) > 0
        time.sleep(GCS_TIMEOUT_S * 3)  # well past Ray's GCS reconnect timeout
        for i in range(2):
            got, answer = ask([2, 1, 0][i:] + [2, 1, 0][:i], f"{ex.question} ({i})")
            assert got == 0 and answer, "served by full prefill while the head is gone"
        assert serve.poll() is None and _engine_pids(serve) >= pids, "vLLM's processes are the same"

        # the head and the shards come back on the same address (same node name: the shard
        # finds its disk chunks); the connector, pinned to host:port, finds them there
        _kvblend_server(ray_port, temp_dir, env)
        back = time.monotonic()
        deadline = time.time() + HANG_S
        while True:
            got, _ = ask([1, 0, 2], ex.question)
            if got >= 3:  # the ingested passages (and the chat head the first request stored)
                break
            assert time.time() < deadline, "hits never resumed:\n" + log_path.read_text()[-3000:]
            time.sleep(1)
        # reported, not asserted (timings are not tests here): issue 35 asks for <= 10 s
        print(f"hits resumed {time.monotonic() - back:.1f} s after `kvblend server` was back")
        assert serve.poll() is None and _engine_pids(serve) >= pids
        log = log_path.read_text()
        assert "cache agent" in log and "exited" in log
    finally:
        stack.close()
        _kill_head(temp_dir)  # this test's Ray only (never a machine-wide `ray stop`)
