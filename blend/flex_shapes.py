"""Which FlexAttention shapes this process has compiled, and how many rows a call pads to.

FlexAttention is compiled with static shapes (:func:`blend.flex_rows._compiled_flex`): one kernel per
``(query rows, keys)`` pair, both padded to :func:`blend.flex_rows.shape_bucket` values. The first
call of a new pair compiles inside that call: 2.4-4.7 s on an H200 (issue 33), and on an H100
the cost-aware plans' exploration blends (one chunk loaded, the rest recomputed: many more rows
than a plan that loads every hit) paid it in the request, 3.3-4.3 s against 0.23 s blends
(issue 34, ``docs/benchmarks.md``).

A call's keys fix its key bucket; its rows need not fix its row bucket. Padded query rows are
nearly free: a whole 128-row tile of pad rows sits before every key and reads no key block
(measured, ``docs/flexpad-h100.json``: 0.716 ms a layer for an 8K blend's rows padded to its key
count, 0.544 ms at their own bucket; the pad rows' ``cat``, 0.19 ms of that, is gone since)
(:func:`blend.flex_rows.pad_rows`). So once this process has *prepared* a device
(:func:`blend.flex_rows.prepare_flex`: every key bucket up to a length compiled with as many rows as
keys, at start-up), a call whose own ``(rows, keys)`` pair is not compiled pads its rows up to
the fewest rows compiled for its keys instead of compiling: no request compiles a shape up to
the prepared length. Unprepared devices pad to their own bucket, as before (a shape compiles on
first use). Bookkeeping only: no torch import; thread-safe (vLLM's worker and a probe-graph
capture may both call in).

Who calls it: :func:`blend.flex_rows.prepare_rows` and :func:`blend.flex_rows._flex_rows` (rows to pad to,
and the shape a call compiled), :func:`blend.flex_rows.prepare_flex` (marks a device prepared).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
#: (device, padded rows, padded keys) FlexAttention has run with in this process
_compiled: set[tuple[str, int, int]] = set()
#: devices whose key buckets were compiled ahead (prepare_flex) -> the longest prepared keys
_prepared: dict[str, int] = {}


def rows_for(num_rows: int, keys: int, device, bucket: int) -> int:
    """Rows to pad a FlexAttention call of ``num_rows`` rows over ``keys`` padded keys to:
    ``bucket`` (the rows' own :func:`blend.flex_rows.shape_bucket`) unless ``device`` was prepared
    and that pair was never compiled, then the fewest rows compiled for ``keys`` that hold
    ``num_rows`` (``bucket`` when none does)."""
    dev = str(device)
    with _lock:
        if dev not in _prepared or (dev, bucket, keys) in _compiled:
            return bucket
        larger = [q for d, q, k in _compiled if d == dev and k == keys and q >= num_rows]
    return min(larger) if larger else bucket


def note_compiled(device, rows: int, keys: int) -> None:
    """A FlexAttention call with ``rows`` padded rows over ``keys`` padded keys ran on ``device``."""
    with _lock:
        _compiled.add((str(device), int(rows), int(keys)))


def mark_prepared(device, max_keys: int) -> None:
    """Every key bucket of ``device`` up to ``max_keys`` has a compiled shape (prepare_flex)."""
    with _lock:
        _prepared[str(device)] = max(int(max_keys), _prepared.get(str(device), 0))


def compiled_shapes(device) -> list[tuple[int, int]]:
    """``(rows, keys)`` pairs compiled on ``device``, sorted (for logs and benchmark JSON)."""
    dev = str(device)
    with _lock:
        return sorted((q, k) for d, q, k in _compiled if d == dev)


def reset() -> None:
    """Forget every shape and preparation (tests)."""
    with _lock:
        _compiled.clear()
        _prepared.clear()
