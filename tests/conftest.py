"""Run order by marker, the GPU skip, and the prepared default model.

Markers (registered in pyproject.toml): ``vllm_engine`` and ``shared_ray`` order the run (see
:data:`ORDER_MARKERS`), ``gpu`` skips a test where there is no CUDA, ``slow`` says a test starts
a vLLM engine or a Ray cluster. Services (redis-server, the S3 endpoint) are started by
fixtures in ``tests/services.py`` (a plugin of this conftest, so every directory has them);
the session Ray cluster by ``tests/cluster/conftest.py``; vLLM engines by session-scoped
fixtures in ``tests/cluster/vllm/conftest.py``. Factories are in ``tests/factories.py``.
"""

from __future__ import annotations

import os
import tempfile

import pytest

#: The service fixtures (redis_url, s3_endpoint, private_redis, ...) for every test directory.
pytest_plugins = ["tests.services"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Chunks a test stores without Ray go to the machine-local disk cache (cluster.cache.local.
# local_client) under disk_path: keep each test session's in a fresh directory, never in the
# user's ~/.cache/kvblend, so no run sees another run's chunks.
os.environ.setdefault("KVBLEND_DISK_PATH", tempfile.mkdtemp(prefix="kvblend-test-disk-"))


#: Run order, by marker (tests with neither run in between, in collection order).
#: vllm_engine first: an in-process vLLM engine walks sys.modules when it starts
#: (vllm.triton_utils.dispatcher) and dies on Flask's LocalProxy objects, which moto's S3 server
#: (the ``s3_endpoint`` fixture, tests that start shards with an S3 tier) imports into this process.
#: shared_ray last: the session Ray cluster of tests/cluster/conftest.py stays up until the end,
#: and no other test's ``kvblend server`` or vLLM connector may join it by ray_address="auto".
ORDER_MARKERS = ("vllm_engine", None, "shared_ray")

#: Fixtures whose tests must carry a marker, or the order above would silently not hold.
FIXTURE_MARKERS = {"blend_llm": "vllm_engine", "ray_cluster": "shared_ray"}


def _order(item) -> int:
    for rank, marker in enumerate(ORDER_MARKERS):
        if marker is not None and item.get_closest_marker(marker) is not None:
            return rank
    return ORDER_MARKERS.index(None)


def pytest_collection_modifyitems(config, items):
    unmarked = [f"{item.nodeid} uses {fixture} without @pytest.mark.{marker}"
                for item in items for fixture, marker in FIXTURE_MARKERS.items()
                if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None]
    if unmarked:
        raise pytest.UsageError("run-order markers missing (see tests/conftest.py):\n" + "\n".join(unmarked))
    items.sort(key=_order)  # stable: collection order within each group
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """HF folder of the bundled SmolLM2-135M-Instruct (prepared once, cached)."""
    from cluster.config import cache_dir, load_config
    from cluster.workloads.model import resolve_model

    return resolve_model("smollm2", cache_dir(load_config(environ={})))


@pytest.fixture(autouse=True, scope="module")
def _no_ray_driver_left_behind(request):
    """After every test module without ``shared_ray`` tests (those share the session cluster),
    this process is no Ray driver any more: a module that connected it and did not disconnect
    would leave it attached to a cluster that a later test stops (``ray stop --force`` in the
    demo), and 60 s later Ray ends the driver's process — this pytest run, without a summary
    (seen 2026-12-02). The leak is disconnected here and reported on stderr."""
    yield
    items = [it for it in request.session.items if it.module is request.module]
    if any(it.get_closest_marker("shared_ray") is not None for it in items):
        return
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        print(f"\n[conftest] {request.module.__name__} left this process connected to Ray: ray.shutdown()",
              file=sys.stderr)
        ray.shutdown()
