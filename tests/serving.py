"""`vllm serve` (or any OpenAI-compatible server command) as a test runs it: started in its own
session with its output in a log file, waited for on ``/health``, stopped with SIGINT (SIGKILL
after 60 s). A server that exits or is not healthy in time fails the test with its log's tail."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator


@contextlib.contextmanager
def http_server(argv: list[str], env: dict, log_path, port: int, ready_s: float = 400.0,
                cwd=None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``argv`` (a list, or ``["bash", "-c", line]``; in ``cwd``, default ours) and yield
    ``(base URL, process)`` once ``GET /health`` answers 200. Raises AssertionError when it
    exits or is not ready in ``ready_s``."""
    import requests

    with open(log_path, "w") as fh:
        proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + ready_s
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"{argv[0]} exited:\n" + open(log_path).read()[-4000:])
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise AssertionError(f"{argv[0]} not ready:\n" + open(log_path).read()[-4000:])
            time.sleep(1)
        yield url, proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
