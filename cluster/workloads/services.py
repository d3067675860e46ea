"""Throwaway backing services for tests and benchmarks: a redis-server and an S3 endpoint.

* :func:`start_redis` runs ``redis-server --port <free> --save "" --appendonly no`` (no
  persistence) as a child process and yields its ``redis://127.0.0.1:<port>/0`` URL.
* :func:`start_s3` runs moto's ``ThreadedMotoServer`` (a real HTTP S3 endpoint, in this
  process) on a free port, creates a bucket and yields ``(endpoint_url, bucket)``.

Both stop what they started on exit. Neither is for production: real deployments point
``redis_url`` / ``s3_url`` at real services.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

# Ray's worker processes listen on 10002-19999 by default (``--min/max-worker-port``).
_FIXED_PORTS_FROM = 20000


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; 32768-60999 if unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    return 32768, 60999


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago, chosen below the kernel's ephemeral
    range and above Ray's worker ports: a port from ``bind(0)`` is an ephemeral one, which any
    outgoing connection (Ray's, redis-py's) may take as its local port before the service we
    pick it for binds it (``Address already in use``). Falls back to ``bind(0)`` when there is
    no such range or 64 random tries found nothing free."""
    lo, _ = _ephemeral_range()
    if lo - _FIXED_PORTS_FROM >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_FIXED_PORTS_FROM, lo)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"service on port {port} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"service on port {port} did not start within {timeout_s} s")


class RedisProcess:
    """A running ``redis-server`` child (see :func:`start_redis`); ``kill()`` stops it hard
    (tests use it to simulate a dead Redis) and ``restart()`` brings it back on the same port."""

    def __init__(self, port: int, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._args = extra_args
        self._dir = tempfile.mkdtemp(prefix="kvblend-redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self._dir, *self._args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, 10.0, self.proc)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def start_redis_process(*extra_args: str) -> Iterator[RedisProcess]:
    """Like :func:`start_redis` but yields the :class:`RedisProcess` (to kill/restart it)."""
    proc = RedisProcess(free_port(), extra_args)
    try:
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def start_redis(*extra_args: str) -> Iterator[str]:
    """Run a private redis-server; yields its URL (``redis://127.0.0.1:<port>/0``).

    Args:
        extra_args: more ``redis-server`` arguments, e.g. ``"--proto-max-bulk-len", "1mb"``.

    Raises:
        RuntimeError: redis-server missing or not listening within 10 s.
    """
    with start_redis_process(*extra_args) as proc:
        yield proc.url


_FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kvblend-test", "AWS_SECRET_ACCESS_KEY": "kvblend-test",
                     "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def start_s3(bucket: str | None = None) -> Iterator[tuple[str, str]]:
    """Run moto's S3 server on a free port with one bucket; yields ``(endpoint_url, bucket)``.

    boto3 finds credentials through its standard chain; where none are set, this sets
    throwaway ``AWS_*`` environment variables for the duration (moto accepts any) and
    restores the environment afterwards.

    Raises:
        RuntimeError: moto not installed or not listening within 10 s.
    """
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        raise RuntimeError(f"start_s3 needs moto[server] and boto3: {e}") from None
    saved = {k: os.environ.get(k) for k in _FAKE_CREDENTIALS}
    for k, v in _FAKE_CREDENTIALS.items():
        os.environ.setdefault(k, v)
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        _wait_port(port, 10.0)
        endpoint = f"http://127.0.0.1:{port}"
        bucket = bucket or f"kvblend-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint, bucket
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
