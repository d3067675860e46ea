"""Shared fixtures: markers, the prepared default model, small factories.

Services (redis-server, the S3 endpoint, Ray) are started by fixtures in
``tests/services.py``; vLLM engines by session-scoped fixtures in ``tests/vllm/``.
"""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Chunks a test stores without Ray go to the machine-local disk cache (cluster.cache.local.
# local_client) under disk_path: keep each test session's in a fresh directory, never in the
# user's ~/.cache/kvblend, so no run sees another run's chunks.
os.environ.setdefault("KVBLEND_DISK_PATH", tempfile.mkdtemp(prefix="kvblend-test-disk-"))


def pytest_collection_modifyitems(config, items):
    # tests/vllm first: its in-process vLLM engines walk sys.modules when they start
    # (vllm.triton_utils.dispatcher) and die on Flask's LocalProxy objects, which moto's S3
    # server (tests/tiers, tests/cluster) imports into this process.
    # tests/cluster last: it holds one Ray cluster for the whole session (torn down at the end),
    # so no other test's `kvblend server` or vLLM connector joins it by ray_address="auto".
    def order(item) -> int:
        path = str(item.fspath)
        return 0 if "/tests/vllm/" in path else 2 if "/tests/cluster/" in path else 1

    items.sort(key=order)
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
