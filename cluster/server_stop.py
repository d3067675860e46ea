"""``kvblend stop [--node NODE] [--drain]``: remove shard actors. Stored data stays: disk
files, Redis and S3.

``--node`` stops only one node's shards (before removing the node; clients re-place its keys
on the remaining shards within seconds, and those keys are misses there); ``--drain`` first
writes the chunks that Redis/S3 lack into them, so the moved keys are still found there.

Host-memory chunks are lost (they live in the shards' object-store objects); ``kvblend server``
brings the shards back and they find their disk chunks again.
"""

from __future__ import annotations

import argparse
import logging

from cluster.server import add_connection_arguments, connect_or_fail

log = logging.getLogger("kvblend.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument("--node", help="only the shards of this Ray node (node id or its first 8 hex "
                                  "chars), e.g. before removing the node")
    p.add_argument("--drain", action="store_true",
                   help="first copy the shards' chunks that Redis/S3 lack into them")


def stop_shards(namespace: str, node: str | None = None, drain: bool = False,
                timeout_s: float = 300.0) -> list[str]:
    """Kill the shard actors in ``namespace`` (no restart), optionally only those of ``node``
    and after :meth:`CacheShard.drain_to_shared`; returns their names. A shard that fails to
    drain is still stopped (its chunks then become misses) and the failure is logged."""
    import ray

    from cluster.ray_util import get_shard, shard_names

    stopped = []
    for name in shard_names(namespace):
        if node is not None and not name.startswith(f"kvblend-shard-{node[:8]}-"):
            continue
        h = get_shard(name, namespace)
        if h is None:
            continue
        if drain:
            try:
                n = ray.get(h.drain_to_shared.remote(timeout_s), timeout=timeout_s + 30)
                log.info("%s: drained %d chunk(s) to the shared tiers", name, n)
            except Exception as e:  # noqa: BLE001 - stop anyway
                log.warning("could not drain %s: %s", name, e)
        try:
            ray.kill(h, no_restart=True)
            stopped.append(name)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            log.warning("could not stop %s: %s", name, e)
    return stopped


def run(args: argparse.Namespace) -> int:
    cfg, ray = connect_or_fail(args)
    if ray is None:
        return 1
    names = stop_shards(cfg.cluster.ray_namespace, args.node, args.drain)
    print(f"stopped {len(names)} shard(s): {', '.join(names) or '-'}")
    return 0
