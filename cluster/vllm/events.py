"""The connector's per-request events: one JSON line per decision, written and read back.

When ``kv_connector_extra_config["stats_path"]`` is set, every connector appends one line per
decision to that file (:class:`EventLog`): ``{"event": "lookup"|"claim"|"load"|"store",
"time": ..., "pid": ..., "request_id": ..., ...}``. Front-end processes (tests, the demo,
examples) read them with :func:`read_events` across vLLM's engine-core process boundary.
:class:`WarnOnce` is the other half of what a connector reports: one log warning per kind of
failure, so a dead cache does not flood the log.

Importing this module imports neither vLLM nor torch (front ends import it to read events).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("kvblend.connector")


class EventLog:
    """One JSON line per event appended to ``path`` (atomic ``O_APPEND`` writes, so the
    scheduler's and the workers' connectors may share one file). ``path=None``: writes nothing.

    Thread-safe: the worker's I/O thread writes ``store`` events. Never raises into vLLM's
    hooks: a file that cannot be written (``OSError``) drops the event, counts it in
    :attr:`write_errors` and logs one warning per instance.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.write_errors = 0
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "time": time.time(), "pid": os.getpid(), **fields},
                          default=str) + "\n"
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
            except OSError as e:
                self.write_errors += 1
                if self.write_errors == 1:
                    log.warning("kvblend: cannot write events to %s (%s); events are dropped",
                                self.path, e)


class WarnOnce:
    """Log a warning the first time each kind ``what`` happens (per connector instance)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)


def read_events(path: str) -> list[dict]:
    """Events written by connectors to ``stats_path`` (tests, demo); ``[]`` before the first."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def planned_stores(path: str) -> int:
    """Chunks the connector's lookups in ``stats_path`` scheduled for storing so far (each
    ``lookup`` event's ``num_store_segments``, ``num_store_prefix`` and
    ``num_standalone_segments``): what :func:`wait_for_stores` waits for."""
    return sum(int(e.get("num_store_segments", 0) or 0) + int(e.get("num_store_prefix", 0) or 0)
               + int(e.get("num_standalone_segments", 0) or 0)
               for e in read_events(path) if e.get("event") == "lookup")


def wait_for_stores(path: str, count: int, timeout_s: float = 120.0) -> bool:
    """Wait until the ``store`` events in ``stats_path`` account for at least ``count`` chunks
    (stored, skipped as already cached, or dropped: the connector's background stores
    finished), so a following request sees them. False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = sum(int(e.get("stored", 0) or 0) + int(e.get("skipped", 0) or 0) + int(e.get("dropped", 0) or 0)
                   for e in read_events(path) if e.get("event") == "store")
        if done >= count:
            return True
        time.sleep(0.05)
    return False
