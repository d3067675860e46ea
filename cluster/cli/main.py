"""The ``kvblend`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules keep heavy imports (ray, vllm, redis, boto3, lz4) inside
``run`` so that ``--help`` works on machines that lack them (the GPU machine).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# (command words, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("config", "show"), "cluster.cli.config_show", "print the effective config and the source of each value"),
    (("model", "prepare"), "cluster.workloads.model", "turn the bundled GGUF model into a Hugging Face folder"),
    (("server",), "cluster.cli.server", "start or join a Ray cluster and bring up the cache shards"),
    (("status",), "cluster.cli.status", "per-shard capacity, use, hits and misses"),
    (("stop",), "cluster.cli.stop", "remove the shard actors (stored data stays)"),
    (("clear",), "cluster.cli.clear", "delete cached chunks"),
    (("ingest",), "cluster.workloads.ingest", "compute and store the canonical KV of a corpus's passages"),
    (("demo",), "cluster.workloads.demo", "the main job: a RAG workload through vLLM replicas sharing one cache"),
    (("bench", "tiers"), "cluster.bench.tiers", "tier throughput vs plain copies"),
    (("bench", "blend"), "cluster.bench.blend", "blend quality and TTFT vs full prefill (HF model)"),
    (("bench", "cluster"), "cluster.bench.cluster", "shard lookup latency and client read throughput"),
    (("bench", "vllm"), "cluster.bench.vllm", "TTFT through vLLM: full, prefix caching, kvblend"),
    (("bench", "gpu"), "cluster.bench.gpu", "GPU blend TTFT and host-to-GPU overlap"),
    (("bench", "faults"), "cluster.bench.faults", "requests through vLLM while Redis, S3, a shard or objects fail"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvblend",
        description="KV-cache reuse for RAG (CacheBlend) in vLLM over a Ray-sharded tiered chunk store.")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, module_name, help_text in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not module_name.startswith(e.name):
                raise
            continue  # command not built in this checkout
        if len(words) == 1:
            p = sub.add_parser(words[0], help=help_text, description=help_text)
        else:
            if words[0] not in groups:
                gp = sub.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
                groups[words[0]].required = True
            p = groups[words[0]].add_parser(words[1], help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except ValueError as e:  # caller mistakes: a clear message, no traceback
        print(f"kvblend: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
