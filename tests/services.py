"""Pytest fixtures for the backing services the suite starts itself (redis-server, moto's S3).

``tests/conftest.py`` loads this module as a plugin (``pytest_plugins``), so every test can take
these fixtures by name; test modules never start services themselves, so the tests of
``tiers/`` reach the service starters of :mod:`cluster.workloads.services` only through them.

* ``redis_server`` — session-wide :class:`cluster.workloads.services.RedisProcess` (``.url``,
  ``.kill()``, ``.restart()``); ``redis_url`` — its URL.
* ``private_redis`` — ``private_redis(*redis_server_args, tls=False, tls_auth_clients="no")
  -> RedisProcess``: a fresh redis-server of this test's own (to kill, or with other settings;
  ``tls=True``: TLS only, its throwaway CA and certificates in ``.tls``), stopped when it ends.
* ``foreign_tls_files`` — :class:`cluster.workloads.services.TLSFiles` of a CA of their own
  (a wrong CA, and a client certificate no server of ``private_redis`` trusts).
* ``s3_endpoint`` — session-wide ``(endpoint_url, bucket)`` of a moto S3 server (a child
  process: this one never imports moto, whose Flask objects break in-process vLLM engines).
* ``unused_port`` — a TCP port on 127.0.0.1 that nobody listened on a moment ago.
"""

from __future__ import annotations

import contextlib

import pytest

from cluster.workloads.services import free_port, make_tls_files, start_redis_process, start_s3


@pytest.fixture(scope="session")
def redis_server():
    with start_redis_process() as proc:
        yield proc


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def private_redis():
    with contextlib.ExitStack() as stack:
        yield lambda *args, **kwargs: stack.enter_context(start_redis_process(*args, **kwargs))


@pytest.fixture
def foreign_tls_files(tmp_path):
    return make_tls_files(str(tmp_path), "foreign")


@pytest.fixture(scope="session")
def s3_endpoint():
    with start_s3() as endpoint:
        yield endpoint


@pytest.fixture
def unused_port() -> int:
    return free_port()
