"""``kvblend server`` keeps its address (issue 35): a head it starts listens on ``head_port``
(default 6390, ``--port`` or ``$KVBLEND_HEAD_PORT``), a taken port is an error that names it
before `ray start` runs, and ``--port`` with ``--block`` (Ray in this process picks its own
port) is refused. ``ray start`` is replaced by a recorder: no process starts."""

from __future__ import annotations

import argparse
import socket
import subprocess

import pytest

from cluster.cli import server
from cluster.config import FIELDS, load_config

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--log-level")
    server.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_default_port_is_fixed_and_not_redis():
    assert FIELDS["head_port"].default == 6390 != 6379
    assert load_config(environ={}).cluster.head_port == 6390
    assert load_config(environ={"KVBLEND_HEAD_PORT": "7001"}).cluster.head_port == 7001


def _start_head_argv(monkeypatch, port: int, *argv: str) -> list[str]:
    ran = []

    def fake_run(cmd, **_):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(server.subprocess, "run", fake_run)
    monkeypatch.setattr("cluster.cli.ray_auth.head_env", lambda exe, no_auth: ({}, None))
    args = _args("--port", str(port), *argv)
    cfg = load_config(environ={}, overrides={"head_port": args.head_port})
    address, _ = server._start_head(cfg, args)
    assert address == f"127.0.0.1:{port}"
    return ran[0]


def test_a_head_started_here_listens_on_the_port_asked(monkeypatch):
    from cluster.workloads.services import free_port

    port = free_port()
    cmd = _start_head_argv(monkeypatch, port, "--no-dashboard")
    assert cmd[1:3] == ["start", "--head"] and f"--port={port}" in cmd


def test_a_taken_port_is_an_error_naming_it_before_ray_starts(monkeypatch):
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(server.PortTaken, match=rf"port {port} is taken.*--address 127\.0\.0\.1:{port}.*--port"):
            _start_head_argv(monkeypatch, port)


def test_a_port_in_time_wait_is_not_taken():
    """A head just ended leaves its accepted connections in TIME_WAIT: not a taken port."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the listening side closes first: its end goes to TIME_WAIT
        client.close()
    server.check_port_free(port)


def test_port_with_block_is_refused(capsys):
    assert server.run(_args("--block", "--port", "7002")) == 2
    assert "--block runs Ray in this process" in capsys.readouterr().err
