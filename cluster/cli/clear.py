"""``kvblend clear [--namespace NS]``: delete cached chunks from every shard's tiers.

Host memory and disk of every shard; Redis and S3 too when those tiers can list their keys.
``--namespace`` is a chunk-namespace digest (16 hex chars, the first part of a chunk key);
without it everything is deleted.
"""

from __future__ import annotations

import argparse
import re

from cluster.cli.connection import add_connection_arguments, connect_or_fail


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument("--namespace", help="only chunks of this namespace digest (16 hex chars)")


def run(args: argparse.Namespace) -> int:
    if args.namespace is not None and not re.fullmatch(r"[0-9a-f]{1,64}", args.namespace):
        raise ValueError(f"--namespace={args.namespace!r}: expected a namespace digest (hex)")
    cfg, ray = connect_or_fail(args)
    if ray is None:
        return 1
    from cluster.cache.lifecycle import shard_names

    if not shard_names(cfg.cluster.ray_namespace):
        print("no shards running: nothing to clear")
        return 1
    from cluster.cache.client import CacheClient

    client = CacheClient(cfg, args.namespace)
    try:
        n = client.clear(args.namespace)
    finally:
        client.close()
    print(f"deleted {n} chunk(s)" + (f" of namespace {args.namespace}" if args.namespace else ""))
    return 0
