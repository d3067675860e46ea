"""``kvblend server``: start (or join) a Ray cluster and bring up the cache shards.

The analogue of ``lmcache server --l1-size-gb 20 --eviction-policy LRU --engine-type blend``::

    kvblend server                      # join the Ray cluster running here (``auto``) or, if
                                        # none, start a head (``ray start --head``) with the
                                        # shard resource; create the shards and exit (Ray and
                                        # the detached shard actors keep running)
    kvblend server --address local      # always start a new head here
    kvblend server --address HOST:PORT  # join that cluster
    kvblend server --port 6391          # a head started here listens there (default 6390)
    kvblend server --block              # start Ray inside this process and serve until
                                        # SIGINT/SIGTERM, then shut that Ray down

Settings come from :func:`cluster.config.load_config` (defaults < YAML < environment < these
flags). Re-running it is safe: shards are created with ``get_if_exists`` (nodes that joined
since get their shards; existing ones are untouched). ``--block`` also re-checks every
:data:`RESCAN_S` seconds for new cache nodes (autoscaling).

Address (issue 35): a head started here listens on ``head_port`` (``--port``, default 6390, not
Redis's 6379), so a head restarted on this machine keeps its address and a connector on another
machine configured with ``ray_address=HOST:6390`` finds it again. A port already taken is an
error that names it; ``--block`` runs Ray inside this process, on a port Ray picks.

Ray token authentication (issue 19): a head started here requires Ray's token
(:mod:`cluster.cli.ray_auth`: created when none exists; ``--no-auth`` says loudly what it
turns off). Object authentication (issue 37): chunk objects are signed and checked under the
key :mod:`cluster.cli.object_key` finds or creates (``~/.kvblend/object_key``, mode 0600, or
``$KVBLEND_OBJECT_KEY_FILE``); ``--no-object-auth`` says loudly what it gives up. Secrets: a
Redis password stays out of the process list when the URL comes through
``$KVBLEND_REDIS_URL`` or ``--redis-url-file PATH``; ``--redis-url`` still works but its value
is visible to ``ps``. The logged config masks it (:func:`cluster.config.log_config`).

Memory: the Ray object store holds every host-tier chunk plus in-flight puts, so a head
started here gets ``--object-store-gib`` set explicitly; it must be at least ``--host-size-gib``
times ``--shards-per-node`` plus :data:`STORE_HEADROOM_GIB` (a value given too small is an error;
when not given, the store is sized to fit and the log says so).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

from cluster.cli.connection import add_connection_arguments, connection_overrides

log = logging.getLogger("kvblend.server")

RESCAN_S = 10.0
#: object-store room beyond the host tiers, for puts in flight (each passes through once)
STORE_HEADROOM_GIB = 0.1


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument("--host-size-gib", type=float, help="host memory per shard, GiB")
    p.add_argument("--disk-path", help="parent directory of the shards' disk tiers")
    p.add_argument("--disk-size-gib", type=float, help="disk tier size per shard, GiB (0 = off)")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--redis-url", help="shared Redis tier, redis://[:password@]host:port/db; a password "
                        "here is visible to every user through `ps`: prefer --redis-url-file or $KVBLEND_REDIS_URL")
    secret.add_argument("--redis-url-file", metavar="PATH",
                        help="read the Redis URL (with its password) from this file, e.g. a mounted Secret; "
                             "keeps the password out of argv ($KVBLEND_REDIS_URL does too)")
    p.add_argument("--s3-url", help="shared S3 tier, s3://bucket[/prefix]")
    p.add_argument("--s3-endpoint-url", help="S3-compatible endpoint")
    p.add_argument("--eviction-policy", choices=("lru", "lfu"))
    p.add_argument("--engine-type", choices=("blend", "prefix"),
                   help="deployment default: connectors blend, or reuse prefixes only")
    p.add_argument("--shards-per-node", type=int, help="shard actors per cache node")
    p.add_argument("--object-store-gib", type=float, help="Ray object store of a head started here, GiB")
    p.add_argument("--port", type=int, dest="head_port",
                   help="GCS port of a head started here (default: config head_port, 6390); connectors on "
                        "other machines use ray_address=HOST:PORT")
    p.add_argument("--dashboard-port", type=int, default=None, help="Ray dashboard port of a head started here")
    p.add_argument("--ray-client-server-port", type=int, default=None,
                   help="Ray Client server port of a head started here (Ray's default 10001)")
    p.add_argument("--metrics-export-port", type=int, default=None,
                   help="Prometheus port of a head started here")
    p.add_argument("--no-dashboard", action="store_true", help="start the head without the dashboard")
    p.add_argument("--temp-dir", default=None,
                   help="Ray's temp/session directory of a head started here (default /tmp/ray; keep it short: "
                        "Ray puts Unix sockets under it)")
    p.add_argument("--no-auth", action="store_true",
                   help="start the Ray head WITHOUT token authentication (default: on; a token is created "
                        "in ~/.ray/auth_token when none exists): anyone who reaches its ports can run code")
    p.add_argument("--no-object-auth", action="store_true",
                   help="neither sign nor check chunk objects (default: on; a key is created in ~/.kvblend/object_key, "
                        "or $KVBLEND_OBJECT_KEY_FILE, when none exists): anyone who can write the disk tier, Redis "
                        "or S3 can plant chunks that change answers")
    p.add_argument("--block", action="store_true",
                   help="run Ray inside this process and serve until interrupted")


_FLAG_FIELDS = ("host_size_gib", "disk_path", "disk_size_gib", "redis_url", "s3_url", "s3_endpoint_url",
                "eviction_policy", "engine_type", "shards_per_node", "object_store_gib", "head_port")


def _start_head(cfg, args) -> tuple[str, str | None]:
    """``ray start --head`` with the shard resource and token authentication
    (:mod:`cluster.cli.ray_auth`); returns the GCS address and where the token is (None with
    ``--no-auth``)."""
    from cluster.cli.ray_auth import head_env

    ray_exe = shutil.which("ray") or os.path.join(os.path.dirname(sys.executable), "ray")
    c = cfg.cluster
    port = c.head_port
    check_port_free(port)
    cmd = [ray_exe, "start", "--head", f"--port={port}",
           f"--object-store-memory={int(c.object_store_gib * 2**30)}",
           f"--resources={json.dumps({c.shard_resource: float(c.shards_per_node)} if c.shard_resource else {})}",
           f"--include-dashboard={'false' if args.no_dashboard else 'true'}"]
    if args.dashboard_port:
        cmd.append(f"--dashboard-port={args.dashboard_port}")
    if args.metrics_export_port:
        cmd.append(f"--metrics-export-port={args.metrics_export_port}")
    if args.ray_client_server_port:
        cmd.append(f"--ray-client-server-port={args.ray_client_server_port}")
    if args.temp_dir:
        cmd.append(f"--temp-dir={args.temp_dir}")
    env, token_where = head_env(ray_exe, no_auth=args.no_auth)
    log.info("starting Ray head: %s", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"`ray start --head` failed ({done.returncode}): {done.stderr[-2000:]}")
    return f"127.0.0.1:{port}", token_where


def check_port_free(port: int) -> None:
    """Raise when TCP ``port`` cannot be bound on this machine (Ray's GCS binds every address).

    Raises:
        PortTaken: another process (a Ray head of another temp dir, a Redis, ...) holds it;
            the message names the port and the two ways on.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as gRPC's listener does: connections of a head just ended (TIME_WAIT) do not hold the
        # port, a process listening there does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            raise PortTaken(
                f"port {port} is taken ({e.strerror or e}): a Ray head there is joined with "
                f"`kvblend server --address 127.0.0.1:{port}`; start a new head on another port with "
                f"`kvblend server --port PORT` (and give connectors ray_address=HOST:PORT)") from None


class PortTaken(RuntimeError):
    """The head's port is held by another process (:func:`check_port_free`)."""


def read_url_file(path: str) -> str:
    """The URL in ``path`` (surrounding whitespace dropped; ``#`` comment lines skipped).

    Raises:
        ValueError: the file cannot be read or holds no URL (the message never quotes it).
    """
    try:
        with open(path) as fh:
            lines = [ln.strip() for ln in fh.read().splitlines()]
    except OSError as e:
        raise ValueError(f"--redis-url-file {path!r} cannot be read: {e.strerror or e}") from None
    urls = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(urls) != 1:
        raise ValueError(f"--redis-url-file {path!r} must hold one URL, found {len(urls)} line(s)")
    return urls[0]


def run(args: argparse.Namespace) -> int:
    from cluster.cli import object_key
    from cluster.config import load_config, log_config

    overrides = connection_overrides(args)
    for name in _FLAG_FIELDS:
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if getattr(args, "redis_url_file", None):
        overrides["redis_url"] = read_url_file(args.redis_url_file)
    if args.block and "ray_address" not in overrides:
        overrides["ray_address"] = "local"
    if args.block and getattr(args, "head_port", None) is not None:
        print("kvblend: --port applies to a head started by `ray start`; --block runs Ray in this process "
              "on a port Ray picks", file=sys.stderr)
        return 2
    environ = dict(os.environ)  # settings only: the object key is object_key.prepare's, below
    cfg = load_config(args.config, overrides=overrides, environ=environ)
    c = cfg.cluster
    needed_gib = cfg.tiers.host_size_gib * c.shards_per_node + STORE_HEADROOM_GIB
    may_start = c.ray_address in ("local", "auto")  # joining host:port: the store exists
    if may_start and c.object_store_gib < needed_gib:
        if cfg.sources.get("object_store_gib", "default") != "default":
            raise ValueError(
                f"object_store_gib={c.object_store_gib} is below host_size_gib={cfg.tiers.host_size_gib} "
                f"x shards_per_node={c.shards_per_node} + {STORE_HEADROOM_GIB} GiB of headroom for "
                f"in-flight puts: the object store holds the host tier")
        # not set by the user: size it to fit the host tier (said once in the log)
        log.info("object_store_gib not set: using %.2f GiB (host tier + headroom)", needed_gib)
        cfg = load_config(args.config, overrides={**overrides, "object_store_gib": needed_gib}, environ=environ)
        c = cfg.cluster
    log_config(cfg)  # secrets masked (issue 19)
    key_where = object_key.prepare(no_object_auth=args.no_object_auth)  # before Ray: a head inherits it
    import ray

    from cluster.cache.connect import connect
    from cluster.cache.lifecycle import start_shards

    token_where = None
    if c.ray_address == "local" and args.block:
        if args.no_auth:  # else ray.init turns token auth on for a new local cluster itself
            from cluster.cli.ray_auth import head_env

            head_env("ray", no_auth=True)
        connect(c, include_dashboard=not args.no_dashboard, dashboard_port=args.dashboard_port,
                metrics_export_port=args.metrics_export_port, temp_dir=args.temp_dir)
    else:
        joined = None if c.ray_address == "local" else connect(c)
        if joined is None:
            if c.ray_address not in ("auto", "local"):
                print(f"kvblend: cannot reach Ray at {c.ray_address!r}", file=sys.stderr)
                return 1
            try:
                address, token_where = _start_head(cfg, args)
            except PortTaken as e:
                print(f"kvblend: {e}", file=sys.stderr)
                return 1
            cfg = load_config(args.config, overrides={**overrides, "ray_address": address})
            c = cfg.cluster
            if connect(c) is None:
                print(f"kvblend: started Ray at {address} but cannot connect", file=sys.stderr)
                return 1
    address = ray.get_runtime_context().gcs_address
    if token_where is not None:
        from cluster.cli.ray_auth import announce

        announce(token_where, address)
    object_key.mark_cluster(c.ray_namespace, key_where)
    shard_env = object_key.shard_env(key_where)
    names = start_shards(cfg, env_vars=shard_env)
    try:
        dashboard = ray._private.worker.get_dashboard_url() or ""
    except Exception:  # noqa: BLE001 - only informative
        dashboard = ""
    print(json.dumps({"address": address, "namespace": c.ray_namespace, "shards": names,
                      "dashboard_url": dashboard}), flush=True)
    if not args.block:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(RESCAN_S):
        try:
            start_shards(cfg, env_vars=shard_env)
        except Exception as e:  # noqa: BLE001 - keep serving
            log.warning("rescan for new cache nodes failed: %s", e)
    from cluster.cache.lifecycle import stop_shards

    stop_shards(c.ray_namespace)
    ray.shutdown()
    return 0
