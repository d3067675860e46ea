"""Reading the connector's per-request events (``kv_connector_extra_config["stats_path"]``).

Kept apart from :mod:`cluster.vllm.connector` so that front-end processes (tests, the demo,
examples) read events without importing vLLM's connector machinery.
"""

from __future__ import annotations

import json
import os
import time


def read_stats(path: str) -> list[dict]:
    """Events written by connectors to ``stats_path`` (tests, demo)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def wait_for_stores(path: str, count: int, timeout_s: float = 120.0) -> bool:
    """Wait until ``stats_path`` holds at least ``count`` ``store`` events (the connector's
    background stores finished), so a following request sees the chunks. False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(1 for e in read_stats(path) if e.get("event") == "store") >= count:
            return True
        time.sleep(0.05)
    return False
