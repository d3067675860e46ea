"""Flags and the Ray connection every cache administration command shares
(``kvblend server|status|stop|clear``): ``--config``, ``--address``, ``--ray-namespace``."""

from __future__ import annotations

import argparse
import sys


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """Flags every cluster command shares: ``--config``, ``--address``, ``--ray-namespace``."""
    p.add_argument("--config", help="YAML config file (our keys or LMCache's)")
    p.add_argument("--address", help="Ray cluster to use: host:port, 'auto' or 'local' (default: config ray_address)")
    p.add_argument("--ray-namespace", help="Ray namespace of the shards (default: config ray_namespace)")


def connection_overrides(args: argparse.Namespace) -> dict:
    out = {}
    if getattr(args, "address", None):
        out["ray_address"] = args.address
    if getattr(args, "ray_namespace", None):
        out["ray_namespace"] = args.ray_namespace
    return out


def connect_or_fail(args: argparse.Namespace, extra: dict | None = None):
    """(config, ray) for the admin commands; prints a message and returns (config, None)
    when Ray cannot be reached."""
    from cluster.cache.connect import connect
    from cluster.config import load_config

    cfg = load_config(args.config, overrides={**connection_overrides(args), **(extra or {})})
    if cfg.cluster.ray_address == "local":
        raise ValueError("--address local starts a new empty Ray; give the running cluster's host:port")
    ray = connect(cfg.cluster)
    if ray is None:
        print(f"kvblend: cannot reach Ray at {cfg.cluster.ray_address!r} (is `kvblend server` running?)",
              file=sys.stderr)
    return cfg, ray
