"""The rig of ``kvblend bench faults``: the product's services, started as an operator would,
with a fault injector (:mod:`cluster.workloads.faults`) in front of each.

* ``redis-server`` and an S3 server (moto), each behind a :class:`~cluster.workloads.faults.TcpProxy`
  (``pass`` until a fault switches it);
* a private local Ray cluster with one shard by ``kvblend server``
  (:class:`~cluster.workloads.local_ray.LocalRay`: host memory, a disk tier, then Redis and S3
  through the proxies), configured through ``KVBLEND_*`` variables, reached by its address;
* the passages' canonical KV stored by :func:`cluster.workloads.ingest.ingest_passages`
  through :func:`cluster.cache.factory.make_client` (``kvblend ingest``'s path), then the
  shards restarted (``kvblend stop`` + ``kvblend server``: host memory empty, so every chunk
  is read from the tiers below it, where the faults are);
* one ``vllm serve`` with the connector (:func:`cluster.workloads.replicas.start_replica`, the
  demo's), whose connector reaches Redis/S3 through the same proxies for direct reads.

:meth:`FaultRig.close` stops everything it started (the replica, the shards, Ray, the proxies,
the services), also after an error. Objects are damaged through the tiers' own classes, opened
on the services' direct addresses (never through a proxy a fault may be holding).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

from cluster.workloads.local_ray import LocalRay
from cluster.workloads.replicas import kvblend_cli

log = logging.getLogger(__name__)

#: the S3 server's prefix for chunk objects
S3_PREFIX = "kvblend"
#: disk tier per shard, GiB (holds every passage of the bench)
DISK_GIB = 4.0


class FaultRig:
    """Services, proxies, cluster and one vLLM replica for the fault rows (see the module
    docstring). Use as a context manager; ``workdir`` holds logs, the disk tier and the
    connector's events (``events_path``)."""

    def __init__(self, workdir: str, model_path: str) -> None:
        self.workdir = os.path.abspath(workdir)
        self.model_path = model_path
        self.events_path = os.path.join(self.workdir, "connector-events.jsonl")
        self.disk_root = os.path.join(self.workdir, "disk")
        self._stack = contextlib.ExitStack()
        self.replica = None

    # -- start and stop ------------------------------------------------------------------------
    def __enter__(self) -> FaultRig:
        try:
            self._start_services()
            self._start_cluster()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_services(self) -> None:
        from cluster.workloads.faults import TcpProxy
        from cluster.workloads.services import start_redis_process, start_s3

        os.makedirs(self.workdir, exist_ok=True)
        self.redis = self._stack.enter_context(start_redis_process())
        endpoint, bucket = self._stack.enter_context(start_s3())
        self.s3_endpoint, self.bucket = endpoint, bucket
        self.redis_proxy = self._stack.enter_context(TcpProxy("127.0.0.1", self.redis.port))
        s3_port = int(endpoint.rsplit(":", 1)[1])
        self.s3_proxy = self._stack.enter_context(TcpProxy("127.0.0.1", s3_port))
        # what every kvblend process of the rig reads (shards, the connector, ingest)
        self.env = {"KVBLEND_REDIS_URL": self.redis_proxy.via(self.redis.url),
                    "KVBLEND_S3_URL": f"s3://{bucket}/{S3_PREFIX}",
                    "KVBLEND_S3_ENDPOINT_URL": self.s3_proxy.via(endpoint),
                    "KVBLEND_S3_REGION": "us-east-1",
                    "KVBLEND_DISK_PATH": self.disk_root, "KVBLEND_DISK_SIZE_GIB": str(DISK_GIB),
                    "KVBLEND_HOST_SIZE_GIB": "1.0",
                    # the rig's own object key, created by its `kvblend server` (issue 37)
                    "KVBLEND_OBJECT_KEY_FILE": os.path.join(self.workdir, "object-key")}
        # a TLS Redis's files (none for the rig's plain one), as KVBLEND_REDIS_TLS_* variables
        self.env.update({f"KVBLEND_{k.upper()}": v for k, v in self.redis.config_values().items()
                         if k != "redis_url"})

    def _start_cluster(self) -> None:
        # a private head, its address pinned in self.env (RAY_ADDRESS): another Ray head started
        # on this machine during the bench cannot redirect the rig's `kvblend` commands
        self.ray = LocalRay(env=self.env)
        self._stack.callback(self.ray.stop)
        self.ray.start()
        self.env = self.ray.env

    def restart_shards(self, while_stopped=None) -> None:
        """``kvblend stop``, ``while_stopped()`` (when given), then ``kvblend server``: host
        memory is empty afterwards, the disk index is rebuilt from the files, Redis and S3
        keep their objects."""
        kvblend_cli("stop", env=self.env, timeout_s=600)
        if while_stopped is not None:
            while_stopped()
        kvblend_cli("server", env=self.env, timeout_s=600)

    def start_replica(self) -> None:
        """One ``vllm serve`` with the connector on every core, events to ``events_path``."""
        from cluster.workloads.replicas import replica_cpus, start_replica, wait_ready

        # the bench sends kvblend_* kv_transfer_params (the full row, ratio 1.0): off by default (#37)
        # ... and measures the load path under faults: every hit is loaded (no cost-aware choice, #34)
        extra = {"ray_address": self.ray.address, "stats_path": self.events_path, "allow_request_overrides": True,
                 "cost_aware": False}
        self.replica = start_replica("faults", self.model_path, connector_extra=extra, log_dir=self.workdir,
                                     env=self.env, cpus=replica_cpus(0, 1))
        self._stack.callback(self.replica.stop)
        wait_ready(self.replica, timeout_s=600.0)

    def close(self) -> None:
        """Stop everything started, newest first (idempotent)."""
        self._stack.close()

    # -- what the faults act on ------------------------------------------------------------------
    def config(self):
        """The rig's :class:`cluster.config.KVBlendConfig` (as its processes read it)."""
        from cluster.config import load_config

        return load_config(environ={**os.environ, **self.env})

    def status(self) -> dict:
        """``kvblend status --json``'s shards: name -> stats (``pid``, ``counters``, ...)."""
        r = kvblend_cli("status", "--json", env=self.env, check=False, timeout_s=120)
        if r.returncode != 0:
            return {}
        return json.loads(r.stdout).get("shards", {})

    def shard_pids(self, wait_s: float = 60.0) -> list[int]:
        """The shards' process ids, asking again for up to ``wait_s`` seconds while a shard
        does not answer ``status`` in time (e.g. working off what queued while it was stopped)."""
        deadline = time.monotonic() + wait_s
        while True:
            shards = self.status()
            if (shards and all("pid" in s for s in shards.values())) or time.monotonic() > deadline:
                return [int(s["pid"]) for s in shards.values() if "pid" in s]
            time.sleep(2.0)

    def direct_tiers(self) -> dict:
        """``{'disk': DiskTier, 'redis': RedisTier, 's3': S3Tier}`` over the shard's disk
        directory and the services' own addresses (not the proxies). Opened once, while the
        shard runs (its status names the directory); the disk view indexes the files there
        then."""
        if getattr(self, "_direct", None) is None:
            self._direct = self._open_direct_tiers()
        return self._direct

    def _open_direct_tiers(self) -> dict:
        from tiers.config import TiersConfig
        from tiers.disk import DiskTier
        from tiers.lower import shared_tiers

        dirs = [s["disk_path"] for s in self.status().values() if s.get("disk_path")]
        if len(dirs) != 1:
            raise RuntimeError(f"expected one shard disk directory, found {dirs}")
        cfg = TiersConfig(**self.redis.config_values(), s3_url=f"s3://{self.bucket}/{S3_PREFIX}",
                          s3_endpoint_url=self.s3_endpoint, s3_region="us-east-1")
        redis, s3 = shared_tiers(cfg)
        # a view of the shard's files: as large as the shard's tier, so its rebuild removes nothing
        disk = DiskTier(dirs[0], int(DISK_GIB * 2**30) * 4, name="disk")
        return {"disk": disk, "redis": redis, "s3": s3}

    def _pids(self) -> dict[str, int]:
        """The rig's processes by name: vLLM's front end (``vllm``), its children
        (``vllm-child-PID-COMM``: the engine core, the connector's cache agent), the shards
        (``shard-PID``) and ``redis-server``."""
        import psutil

        out: dict[str, int] = {}
        if self.replica is not None:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(self.replica.proc.pid)
                out["vllm"] = root.pid
                for p in root.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        out[f"vllm-child-{p.pid}-{p.name()}"] = p.pid
        out.update({f"shard-{pid}": pid for pid in self.shard_pids()})
        if self.redis.proc is not None:
            out["redis-server"] = self.redis.proc.pid
        return out

    def process_rss_mib(self) -> dict[str, float]:
        """Resident memory (MiB) of the rig's processes (see :meth:`_pids`), by name."""
        return {name: m["rss"] for name, m in self.process_memory_mib().items()}

    def process_memory_mib(self) -> dict[str, dict[str, float]]:
        """Per process of :meth:`process_rss_mib`: ``rss`` and its parts from
        ``/proc/PID/status`` (``anon``: private heap; ``shmem``: shared memory mapped and
        touched, e.g. Ray's object store; ``file``: mapped files), MiB. Tells a growing heap
        from pages of a bounded shared store counted in RSS."""
        out: dict[str, dict[str, float]] = {}
        for name, pid in self._pids().items():
            fields = _proc_status_kib(pid)
            if "VmRSS" in fields:
                out[name] = {"rss": fields["VmRSS"] / 1024, "anon": fields.get("RssAnon", 0) / 1024,
                             "shmem": fields.get("RssShmem", 0) / 1024, "file": fields.get("RssFile", 0) / 1024}
        return out


def _proc_status_kib(pid: int) -> dict[str, int]:
    """The ``kB`` fields of ``/proc/PID/status`` (``VmRSS``, ``RssAnon``, ...); empty when the
    process is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0])
    except OSError:
        return {}
    return out


def wait_until(check, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    """Poll ``check()`` until true; a hang guard (``RuntimeError`` naming ``what`` past
    ``timeout_s`` seconds)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
