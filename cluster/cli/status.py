"""``kvblend status [--json]``: per shard, its node, capacity and use per tier, hits, misses,
evictions (a ``rich`` table, or JSON for scripts and tests).

The node column shows the shard's stable node name (``$KVBLEND_NODE_NAME`` or the host name,
which names its disk directory) with the first 8 hex digits of its current Ray node id; each
shard's disk directory is listed below the table (:mod:`cluster.cache.identity`).

A shard that does not answer within ``call_timeout_s`` is listed as ``unreachable``.
"""

from __future__ import annotations

import argparse
import json

from cluster.cli.connection import add_connection_arguments, connect_or_fail


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def collect(namespace: str, timeout_s: float) -> dict[str, dict]:
    """``{shard name: stats() | {'error': ...}}`` for every shard in ``namespace``."""
    import ray

    from cluster.cache.lifecycle import get_shard, shard_names

    refs = {}
    out: dict[str, dict] = {}
    for name in shard_names(namespace):
        h = get_shard(name, namespace)
        if h is None:
            out[name] = {"error": "gone"}
            continue
        refs[name] = h.stats.remote()
    for name, ref in refs.items():
        try:
            out[name] = ray.get(ref, timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead shard is a row, not a crash
            out[name] = {"error": f"unreachable: {type(e).__name__}"}
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def run(args: argparse.Namespace) -> int:
    cfg, ray = connect_or_fail(args)
    if ray is None:
        return 1
    shards = collect(cfg.cluster.ray_namespace, cfg.cluster.call_timeout_s)
    if args.json:
        print(json.dumps({"namespace": cfg.cluster.ray_namespace, "shards": shards}, indent=2, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvblend shards (Ray namespace {cfg.cluster.ray_namespace})")
    for col in ("shard", "node", "tier", "used GiB", "capacity GiB", "chunks", "hits", "misses",
                "evictions"):
        table.add_column(col, justify="left" if col in ("shard", "node", "tier") else "right",
                         no_wrap=col == "shard")
    for name, st in shards.items():
        if "error" in st:
            table.add_row(name, "-", "-", "-", "-", "-", "-", "-", st["error"])
            continue
        counters = st.get("counters", {})
        node = f"{st.get('node_name', '?')} ({st.get('node_id', '')[:8]})"
        first = True
        for tier, ts in st.get("tiers", {}).items():
            table.add_row(name if first else "", node if first else "", tier,
                          _gib(ts.get("bytes_used", 0)), _gib(ts.get("capacity_bytes", 0)),
                          str(int(ts.get("num_chunks", 0))), str(counters.get(f"hits_{tier}", 0)),
                          str(counters.get("misses", 0)) if first else "",
                          str(int(ts.get("evictions", 0))))
            first = False
    Console(width=140).print(table)
    for name, st in shards.items():
        if st.get("disk_path"):
            print(f"{name}: disk {st['disk_path']}")
    if not shards:
        print("no shards running (start them with `kvblend server`)")
    return 0
