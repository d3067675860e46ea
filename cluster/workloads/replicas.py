"""Run ``vllm serve`` replicas as subprocesses and time requests against them.

Used by the demo, ``kvblend bench vllm`` and the tests that run the README's ``vllm serve``
line. TTFT is measured the way a client sees it: from sending a streaming completion request
to receiving the first token's chunk.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from cluster.vllm.plugin import CONNECTOR_MODULE, CONNECTOR_NAME
from cluster.workloads.services import free_port

log = logging.getLogger("kvblend.serving")


def default_dtype() -> str:
    """dtype of served models and their KV here: bfloat16 on a GPU machine, float32 on CPU.

    vLLM's CPU backend computes bf16 GEMMs slowly on CPUs without AVX512-BF16/AMX (our 2-core
    machines have neither), so CPU demos and tests serve in float32; the chunk namespace
    includes the KV dtype, so ingest and the replicas must agree.
    """
    try:
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"
    except ImportError:
        return "float32"


def kv_transfer_config(extra: dict | None = None) -> str:
    cfg = {"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg, separators=(",", ":"))


@dataclass
class Replica:
    """A running ``vllm serve`` subprocess."""

    name: str
    port: int
    proc: subprocess.Popen
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def replica_cpus(index: int, num_replicas: int) -> str | None:
    """Disjoint CPU ranges for ``num_replicas`` replicas on this machine (None if too few CPUs)."""
    n = len(os.sched_getaffinity(0))
    per = n // num_replicas
    if per < 1:
        return None
    first = index * per
    return str(first) if per == 1 else f"{first}-{first + per - 1}"


def vllm_executable() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def start_replica(name: str, model_path: str, *, connector_extra: dict | None = None,
                  use_connector: bool = True, prefix_caching: bool = False,
                  max_model_len: int = 8192, kv_cache_gib: int = 1, dtype: str | None = None,
                  log_dir: str = ".", extra_args: list[str] | None = None,
                  env: dict | None = None, cpus: str | None = None) -> Replica:
    """Start ``vllm serve`` (not waiting for it; see :func:`wait_ready`).

    Args:
        cpus: CPU ids the engine's OpenMP threads are bound to (vLLM's
            ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0"`` or ``"0-3"``); None = vLLM's default
            (one core fewer than the machine has: on 2 cores a 3.5K-token prefill took 24 s
            with it, 12 s bound to ``"0-1"``, 2026-11-29). Engines that compute at the same
            time must get disjoint CPUs (two engines busy on the same cores ran ~40x slower:
            spinning OpenMP threads); engines used one at a time may share them.
    """
    port = free_port()
    dtype = dtype or default_dtype()
    cmd = [*vllm_executable(), "serve", model_path, "--served-model-name", "model",
           "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
           "--max-model-len", str(max_model_len), "--dtype", dtype,
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if use_connector:
        cmd += ["--kv-transfer-config", kv_transfer_config(connector_extra)]
    cmd += list(extra_args or [])
    e = dict(os.environ)
    e.update({"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    if cpus is not None:
        e["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    e.update(env or {})
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"vllm-{name}.log")
    fh = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=e, start_new_session=True)
    log.info("started replica %s on port %d (log %s)", name, port, log_path)
    return Replica(name, port, proc, log_path)


def wait_ready(replica: Replica, timeout_s: float = 300.0) -> None:
    """Wait for ``/health``.

    Raises:
        RuntimeError: the process exited or did not become healthy in time (with its log tail).
    """
    import requests

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if replica.proc.poll() is not None:
            raise RuntimeError(f"vllm replica {replica.name} exited ({replica.proc.returncode}):\n"
                               + tail(replica.log_path))
        try:
            if requests.get(replica.url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm replica {replica.name} not ready in {timeout_s:.0f} s:\n" + tail(replica.log_path))


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except OSError:
        return ""


@dataclass(frozen=True)
class Completion:
    """A streamed completion: ``ttft_s``/``total_s`` from the request's send; ``sent_at``: that
    send, wall-clock seconds (``time.time()``, comparable with the connector's event times);
    ``id``: the response's id (vLLM's request id in the connector's events starts with it)."""

    text: str
    ttft_s: float
    total_s: float
    sent_at: float = 0.0
    id: str = ""


def complete(url: str, prompt: str | list[int], max_tokens: int = 16, timeout_s: float = 600.0,
             kv_transfer_params: dict | None = None, cache_salt: str | None = None) -> Completion:
    """Greedy streaming completion; TTFT = time to the first streamed token. ``cache_salt``:
    vLLM's per-request prefix-cache salt (requests reuse only blocks of the same salt).

    Raises:
        RuntimeError: an HTTP error (with the server's message).
    """
    import requests

    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True}
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    if cache_salt:
        body["cache_salt"] = cache_salt
    sent_at = time.time()
    t0 = time.perf_counter()
    ttft = None
    rid = ""
    parts: list[str] = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=timeout_s) as r:
        if r.status_code != 200:
            raise RuntimeError(f"completion failed ({r.status_code}): {r.text[:500]}")
        for line in r.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunk = json.loads(data)
            rid = rid or str(chunk.get("id", ""))
            parts.append(chunk["choices"][0].get("text", ""))
    total = time.perf_counter() - t0
    return Completion("".join(parts), ttft if ttft is not None else total, total, sent_at, rid)


def kvblend_cli(*args: str, check: bool = True, env: dict[str, str] | None = None,
                timeout_s: float | None = None) -> subprocess.CompletedProcess:
    """Run ``kvblend ARGS`` with this interpreter (output captured), ``env`` added to the
    environment (secrets go there, never into argv).

    Raises:
        RuntimeError: a non-zero exit when ``check`` (with the command's output).
        subprocess.TimeoutExpired: past ``timeout_s`` seconds (None: no limit).
    """
    cmd = [sys.executable, "-m", "cluster.cli.main", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                       env={**os.environ, **env} if env else None)
    if check and r.returncode != 0:
        raise RuntimeError(f"`kvblend {' '.join(args)}` failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return r
