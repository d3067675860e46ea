"""The throwaway services the suite and the benchmarks start (cluster.workloads.services): a
redis-server child that can be killed and restarted empty, extra server arguments, a clear
error without the binary, and moto's S3 endpoint (usable, environment restored after)."""

from __future__ import annotations

import os

import boto3
import pytest
import redis

from cluster.workloads import services
from cluster.workloads.services import start_redis, start_redis_process, start_s3

pytestmark = pytest.mark.cluster



def test_redis_process_is_killed_restarted_empty_and_stopped():
    with start_redis_process() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        assert client.set("k", b"v") and client.get("k") == b"v"
        server.kill()
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, socket_timeout=2).ping()
        server.restart()
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        assert client.ping() and client.get("k") is None  # no persistence: empty again
        workdir = server._dir
    assert server.proc.poll() is not None and not os.path.exists(workdir)


def test_start_redis_passes_extra_server_arguments():
    with start_redis("--maxmemory", "1mb") as url:
        assert redis.Redis.from_url(url).config_get("maxmemory") == {"maxmemory": str(2**20)}


def test_missing_redis_server_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(services.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="redis-server is not installed"), start_redis():
        pass


def test_s3_endpoint_serves_its_bucket_and_restores_the_environment(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    with start_s3() as (endpoint, bucket):
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.put_object(Bucket=bucket, Key="chunk", Body=b"\x00kv\xff")
        assert s3.get_object(Bucket=bucket, Key="chunk")["Body"].read() == b"\x00kv\xff"
        assert os.environ["AWS_ACCESS_KEY_ID"] == "kvblend-test"
    assert "AWS_ACCESS_KEY_ID" not in os.environ and "AWS_DEFAULT_REGION" not in os.environ


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    """An ephemeral port can be taken by any outgoing connection between the pick and the bind
    (CI: vLLM's ``Address already in use`` beside a Ray head), so picks stay below that range."""
    import socket

    lo, hi = services._ephemeral_range()
    ports = [services.free_port() for _ in range(20)]
    for port in ports:
        assert 20000 <= port < lo or lo - 20000 < 1000, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert len(set(ports)) > 1


def test_free_port_falls_back_to_the_kernels_pick_without_room_below_the_ephemeral_range(monkeypatch):
    real_lo, real_hi = services._ephemeral_range()
    monkeypatch.setattr(services, "_ephemeral_range", lambda: (20100, 60999))
    assert real_lo <= services.free_port() <= real_hi  # bind(0): the kernel's ephemeral pick


def test_s3_endpoint_runs_in_a_child_process_and_this_process_never_imports_moto():
    """moto's server in this process broke in-process vLLM engines started after it (Flask's
    ``LocalProxy`` objects in ``sys.modules``): the endpoint is a child process, so the caller
    imports no moto module, and the child is gone once the context exits."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from cluster.workloads.services import start_s3\n"
            "with start_s3() as (endpoint, bucket):\n"
            "    import boto3\n"
            "    boto3.client('s3', endpoint_url=endpoint, region_name='us-east-1').head_bucket(Bucket=bucket)\n"
            "print(sorted(m for m in sys.modules if m == 'moto' or m.startswith('moto.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
