"""Where ``kvblend bench faults`` puts each row's chunks, and the fault each row applies.

:func:`ingest` stores passages the way ``kvblend ingest`` does; :func:`place` then (while the
shards are stopped, so the disk index is rebuilt from what it leaves) completes every tier's
copies and leaves each row's chunks only in the tiers its fault is about; :func:`fault`
applies a row's fault for the duration of a ``with`` block and lifts it after, also on an
error. The injectors are :mod:`cluster.workloads.faults`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
from collections.abc import Iterator

log = logging.getLogger(__name__)

#: tiers each row's chunks are removed from before the shards restart (the rest keep them)
REMOVED_BEFORE_RESTART = {"redis_blackhole": ("disk",), "s3_throttled": ("disk", "redis")}
#: seconds the S3 proxy holds each read in ``s3_throttled`` (longer than a lookup's deadline)
S3_DELAY_S = 1.0
#: seconds one request may take before it counts as failed
REQUEST_TIMEOUT_S = 300.0
#: damage of the ``corrupt_objects`` row, by key in turn (:func:`cluster.workloads.faults.corrupted`)
DAMAGE = ("layer", "truncate", "oversized")


def ingest(rig, passages: list[str], model_path: str) -> str:
    """Store the canonical KV of ``passages`` through the cluster (host memory, written
    through to disk, Redis and S3) as ``kvblend ingest`` does, in the dtype the replica
    serves; returns the namespace digest. Disconnects from Ray afterwards."""
    import ray
    import torch

    from cluster.cache.factory import make_client
    from cluster.env import configure_object_auth
    from cluster.namespace import fingerprint_cache_path, namespace_for
    from cluster.workloads.ingest import build_engine, ingest_passages
    from cluster.workloads.replicas import default_dtype

    cfg = rig.config()
    configure_object_auth({**os.environ, **rig.env})  # the rig's object key, as `kvblend ingest` loads it
    dtype = default_dtype()
    digest = namespace_for(model_path, dtype, fingerprint_cache=fingerprint_cache_path(cfg)).digest()
    engine, tokenizer = build_engine(model_path, dtype)
    client = make_client(cfg, digest)
    try:
        report = ingest_passages(passages, engine, tokenizer, client, digest, kv_dtype=getattr(torch, dtype),
                                 progress=False)
    finally:
        client.close()
        if ray.is_initialized():
            ray.shutdown()
    log.info("bench faults: ingested %d passages (%d tokens) in %.1f s", report.stored, report.tokens,
             report.seconds)
    return digest


def keys_of(tokenizer, digest: str, passages: list[str]) -> list:
    """The chunk keys of ``passages`` (as the connector and ingest key them)."""
    from blend.segments import chunk_token_ids
    from tiers.keys import segment_key

    return [segment_key(digest, chunk_token_ids(tokenizer, p)) for p in passages]


def place(tiers: dict, keys_by_row: dict[str, list]) -> dict[str, int]:
    """Give every tier a copy of each row's chunks, then remove them from the tiers of
    :data:`REMOVED_BEFORE_RESTART` (``tiers``: :meth:`cluster.bench.fault_rig.FaultRig.direct_tiers`).
    The copies: a write-through the ingest lost (an I/O timeout on a loaded machine) would
    leave a row's fault fewer copies to act on than it promises. Returns objects removed per tier."""
    from cluster.workloads.faults import remove_object
    from tiers.format import FormatError
    from tiers.reader import validate_object

    copied: dict[str, int] = {}
    for key in (k for keys in keys_by_row.values() for k in keys):
        held = {name: tier.get(key) for name, tier in tiers.items()}
        valid = None
        for obj in (o for o in held.values() if o is not None):
            with contextlib.suppress(FormatError):
                validate_object(obj, key)
                valid = bytes(obj)
                break
        for name, obj in held.items():
            if valid is not None and obj is None and tiers[name].put(key, valid):
                copied[name] = copied.get(name, 0) + 1
    if copied:
        log.warning("bench faults: copied chunks the ingest did not write through: %s", copied)
    removed: dict[str, int] = {}
    for row, names in REMOVED_BEFORE_RESTART.items():
        for key in keys_by_row.get(row, []):
            for name in names:
                with contextlib.suppress(LookupError):  # never written there: nothing to remove
                    remove_object(tiers[name], key)
                    removed[name] = removed.get(name, 0) + 1
    return removed


@contextlib.contextmanager
def fault(rig, row: str, keys: list, *, s3_delay_s: float) -> Iterator[dict]:
    """Apply ``row``'s fault (see :mod:`cluster.bench.faults`) to ``rig`` and ``keys``; yields
    what was done (objects damaged or removed per tier)."""
    from cluster.workloads.faults import (
        BLACKHOLE,
        PASS,
        SLOW,
        corrupt_object,
        remove_object,
        sigstopped,
    )

    done: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        if row == "redis_blackhole":
            rig.redis_proxy.set_mode(BLACKHOLE)
            stack.callback(rig.redis_proxy.set_mode, PASS)
        elif row == "s3_throttled":
            rig.s3_proxy.set_mode(SLOW, s3_delay_s)
            stack.callback(rig.s3_proxy.set_mode, PASS)
        elif row == "shard_sigstop":
            for pid in rig.shard_pids():
                stack.enter_context(sigstopped(pid))
                done["stopped"] = done.get("stopped", 0) + 1
        elif row in ("corrupt_objects", "deleted_object"):
            for i, key in enumerate(keys):
                for name, tier in rig.direct_tiers().items():
                    try:
                        if row == "corrupt_objects":
                            corrupt_object(tier, key, DAMAGE[i % len(DAMAGE)])
                        else:
                            remove_object(tier, key)
                    except LookupError:
                        continue
                    done[name] = done.get(name, 0) + 1
        elif row != "no_fault":
            raise ValueError(f"unknown fault row {row!r}")
        yield done


def send(rig, prompts, reference, max_tokens: int, params: dict) -> dict:
    """Send ``prompts`` (token ids) to the rig's replica one at a time with
    ``kv_transfer_params`` ``params``; ``requests``, ``failed_requests``, ``wrong_outputs``
    (text differs from ``reference[i]``; None: not compared), ``ttft_p50_s``, ``ttft_p99_s``,
    ``ttfts_s``, ``texts`` (None for a failed request)."""
    from cluster.workloads.demo_report import quantile
    from cluster.workloads.replicas import complete

    ttfts, texts, failed, wrong = [], [], 0, 0
    for i, ids in enumerate(prompts):
        try:
            c = complete(rig.replica.url, ids, max_tokens=max_tokens, timeout_s=REQUEST_TIMEOUT_S,
                         kv_transfer_params=params)
        except Exception as e:  # noqa: BLE001 - a failed request is the measurement
            log.warning("request failed: %s: %s", type(e).__name__, e)
            failed += 1
            texts.append(None)
            continue
        ttfts.append(c.ttft_s)
        texts.append(c.text)
        if reference is not None and c.text != reference[i]:
            wrong += 1
    return {"requests": len(prompts), "failed_requests": failed, "wrong_outputs": wrong,
            "ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_p99_s": quantile(ttfts, 0.99) if ttfts else float("nan"), "ttfts_s": ttfts, "texts": texts}

