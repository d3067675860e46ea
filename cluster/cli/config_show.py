"""``kvblend config show``: the effective configuration and where each value came from.

Secrets are masked: the password of a URL (``redis_url: redis://:***@host:6379/0``,
:func:`cluster.config.redacted`); the other values are shown as they are."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (our keys or LMCache's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field (highest precedence); repeatable")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def run(args: argparse.Namespace) -> int:
    from cluster.config import describe_fields, load_config, redacted

    cfg = load_config(args.config, overrides=parse_sets(args.set))
    flat = redacted(cfg)  # never a password (issue 19)
    if args.json:
        print(json.dumps({k: {"value": v, "source": cfg.sources[k]} for k, v in flat.items()},
                         indent=2, default=list))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="kvblend effective config")
    for col in ("field", "value", "source", "meaning"):
        table.add_column(col, overflow="fold")
    docs = {r["name"]: r["doc"] for r in describe_fields()}
    for k, v in flat.items():
        table.add_row(k, escape(repr(v)), escape(cfg.sources[k]), escape(docs[k]))
    Console(width=160).print(table)
    return 0
