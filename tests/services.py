"""Session-scoped pytest fixtures for the backing services the suite starts itself.

Import them into a test package's ``conftest.py`` (``from services import *`` works because
``tests/`` is on ``sys.path`` once ``tests/conftest.py`` is loaded):

* ``redis_server`` — a :class:`cluster.workloads.services.RedisProcess` (``.url``, ``.kill()``,
  ``.restart()``); ``redis_url`` — its URL.
* ``s3_endpoint`` — ``(endpoint_url, bucket)`` of a moto S3 server.
"""

from __future__ import annotations

import pytest

from cluster.workloads.services import start_redis_process, start_s3

__all__ = ["redis_server", "redis_url", "s3_endpoint"]


@pytest.fixture(scope="session")
def redis_server():
    with start_redis_process() as proc:
        yield proc


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def s3_endpoint():
    with start_s3() as endpoint:
        yield endpoint
