"""``kvblend clear [--namespace NS] [--shared] [--stale]``: delete cached chunks.

* Always: host memory and disk of every running shard (through Ray).
* With ``--shared``: also the chunk objects in the shared tiers the config names (Redis under
  its key prefix, the S3 prefix), opened directly (:func:`tiers.lower.shared_tiers`), so it
  works with no shard running and even with no Ray at all. Those tiers are shared by every
  deployment that uses them, hence the flag. Only values under chunk keys whose first bytes
  read as our chunk objects of this or an older format version are deleted (Redis:
  ``SCAN MATCH <prefix>...`` + ``GETRANGE`` + ``UNLINK``, never ``FLUSHDB``; S3: paginated
  listing + a ranged GET each + ``DeleteObjects``); newer-format objects (an upgraded
  deployment sharing the tier) and foreign values are kept and counted in the report; see
  :mod:`tiers.ownership`, :meth:`tiers.redis_tier.RedisTier.clear` and
  :meth:`tiers.s3.S3Tier.clear`.
* Without ``--shared``, when shared tiers are configured, one line says they were left alone.

``--namespace`` is a chunk-namespace digest (16 hex chars, the first part of a chunk key);
without it every namespace is deleted. ``--stale`` deletes only chunk objects of an *older*
format version (written before an upgrade that moved it, never read again; one read of each
object's 16-byte prefix), never a newer one, and in Redis and S3, while this process has an
object key, those whose header tag does not check under it (signed under a key since rotated,
or unsigned: never read again; one read of each object's first 64 KiB). Prints what was deleted and kept per tier. Exit
status: 0 when
everything asked for was cleared; 1 when a shared tier failed, or nothing could be cleared
(no shard reachable and, without ``--shared``, nothing else to do).
"""

from __future__ import annotations

import argparse
import re
import sys

from cluster.cli.connection import add_connection_arguments, connection_overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument("--namespace", help="only chunks of this namespace digest (16 hex chars); default: all")
    p.add_argument("--shared", action="store_true",
                   help="also delete the chunks in the shared tiers of the config (Redis under its key "
                        "prefix, the S3 bucket prefix), which every deployment using them shares; "
                        "works without running shards or Ray. Without it Redis and S3 are left alone")
    p.add_argument("--stale", action="store_true",
                   help="only chunk objects of an older format version (written before an upgrade; "
                        "never read again) and, in Redis and S3, those signed under another object key "
                        "(after a rotation) or unsigned, keeping every current chunk and any newer-format one")


def run(args: argparse.Namespace) -> int:
    if args.namespace is not None and not re.fullmatch(r"[0-9a-f]{1,64}", args.namespace):
        raise ValueError(f"--namespace={args.namespace!r}: expected a namespace digest (hex)")
    from cluster.config import load_config

    cfg = load_config(args.config, overrides=connection_overrides(args))
    if cfg.cluster.ray_address == "local":
        raise ValueError("--address local starts a new empty Ray; give the running cluster's host:port")
    what = f" of namespace {args.namespace}" if args.namespace else ""
    what += " of an older format version" if args.stale else ""
    shards_ok = _clear_shards(cfg, args.namespace, what, args.shared, args.stale)
    configured = [name for name, url in (("redis", cfg.tiers.redis_url), ("s3", cfg.tiers.s3_url)) if url]
    if not args.shared:
        if configured:
            print(f"left the shared tiers ({', '.join(configured)}) alone: "
                  "run `kvblend clear --shared` to delete their chunks too")
        return 0 if shards_ok else 1
    if not configured:
        print("no shared tiers configured (redis_url, s3_url): nothing more to clear")
        return 0 if shards_ok else 1
    return 0 if _clear_shared(cfg, args.namespace, what, configured, args.stale) else 1


def _clear_shards(cfg, namespace: str | None, what: str, quiet_unreachable: bool, stale: bool) -> bool:
    """Host and disk of every running shard; False when none was reachable."""
    from cluster.cache.connect import connect

    ray = connect(cfg.cluster)
    if ray is None:
        if quiet_unreachable:
            print(f"no shards reachable (no Ray at {cfg.cluster.ray_address!r}): host/disk not cleared")
        else:
            print(f"kvblend: cannot reach Ray at {cfg.cluster.ray_address!r} (is `kvblend server` running?)",
                  file=sys.stderr)
        return False
    from cluster.cache.lifecycle import shard_names

    if not shard_names(cfg.cluster.ray_namespace):
        print("no shards running: host/disk not cleared")
        return False
    from cluster.cache.client import CacheClient

    client = CacheClient(cfg, namespace)
    try:
        n = client.clear(namespace, stale)
    finally:
        client.close()
    print(f"deleted {n} chunk(s){what} from the shards' host/disk tiers")
    return True


def _clear_shared(cfg, namespace: str | None, what: str, configured: list[str], stale: bool) -> bool:
    """Clear each configured shared tier directly; False when any could not be cleared."""
    from tiers.lower import shared_tiers

    tiers = shared_tiers(cfg.tiers)
    ok = True
    opened = {t.name for t in tiers}
    for name in configured:
        if name not in opened:  # shared_tiers logged why
            print(f"{name}: could not be opened (see the warning above): not cleared", file=sys.stderr)
            ok = False
    for tier in tiers:
        where = _describe(tier)
        try:
            n = tier.clear(namespace, stale=stale)
        except OSError as e:
            print(f"{tier.name} ({where}): {e}", file=sys.stderr)
            ok = False
            continue
        finally:
            tier.close()
        kept = n.describe_skipped() if hasattr(n, "describe_skipped") else ""
        print(f"{tier.name} ({where}): deleted {n} chunk object(s){what}{kept}")
    return ok


def _describe(tier) -> str:
    """Where a shared tier's chunks live, without credentials."""
    if hasattr(tier, "bucket"):
        return f"s3://{tier.bucket}/{tier.prefix}"
    return f"key prefix {tier.key_prefix!r}"
