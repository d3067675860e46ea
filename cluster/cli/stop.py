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

from cluster.cli.connection import add_connection_arguments, connect_or_fail


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument("--node", help="only the shards of this Ray node (node id or its first 8 hex "
                                  "chars), e.g. before removing the node")
    p.add_argument("--drain", action="store_true",
                   help="first copy the shards' chunks that Redis/S3 lack into them")


def run(args: argparse.Namespace) -> int:
    from cluster.cache.lifecycle import stop_shards

    cfg, ray = connect_or_fail(args)
    if ray is None:
        return 1
    names = stop_shards(cfg.cluster.ray_namespace, args.node, args.drain)
    print(f"stopped {len(names)} shard(s): {', '.join(names) or '-'}")
    return 0
