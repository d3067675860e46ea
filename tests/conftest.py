"""Shared fixtures: markers, the prepared default model, small factories.

Services (redis-server, the S3 endpoint, Ray) are started by fixtures in
``tests/services.py``; vLLM engines by session-scoped fixtures in ``tests/vllm/``.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
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
    from cluster.model import resolve_model

    return resolve_model("smollm2", cache_dir(load_config(environ={})))
