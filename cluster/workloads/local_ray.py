"""A private local Ray cluster with kvblend shards, for the workloads that start their own
(``kvblend demo``, ``kvblend bench faults``).

Ray's ``"auto"`` address is the one in ``/tmp/ray/ray_current_cluster`` (under ``$RAY_TMPDIR`` when set), which the newest Ray
head started on the machine overwrites. A workload that started a cluster and later reached it
by ``"auto"`` (``kvblend status``, ``kvblend stop``, the connector's ``ray_address``) followed
any head started after its own: on 2026-12-03 a test run during the soak of ``bench faults``
started (and stopped) two heads, and every later ``kvblend status`` of the bench went to the
test's dead cluster, so the shard's memory was never read. And its ``ray stop --force`` at the
end ended every Ray cluster on the machine, an operator's included.

:class:`LocalRay` therefore

* starts the head with ``kvblend server --address local --temp-dir DIR`` (a fresh ``DIR``):
  never joins a running cluster, and leaves ``/tmp/ray/ray_current_cluster`` alone, so no
  other process's ``"auto"`` joins this one;
* gives its address to everything the workload starts (:attr:`LocalRay.env` holds
  ``RAY_ADDRESS`` and ``KVBLEND_RAY_ADDRESS``; :attr:`LocalRay.address` for a connector's
  ``ray_address``);
* takes free ports for its dashboard and Ray Client server (Ray's fixed 8265 and 10001 belong
  to whichever cluster started first; a head whose dashboard port is taken does not start);
* stops only its own processes: ``kvblend stop``, then this user's Ray processes whose command
  line names ``DIR`` or this cluster's GCS address (GCS, raylet, dashboard, the Ray Client
  server, ...) and their children, SIGTERM then SIGKILL; never a machine-wide ``ray stop``.
  ``python -m cluster.workloads.local_ray stop DIR ADDRESS`` does the same for a cluster that
  ``kvblend demo --keep`` left up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile

from cluster.workloads.replicas import kvblend_cli
from cluster.workloads.services import free_port

log = logging.getLogger(__name__)

#: seconds a stopped node's processes get between SIGTERM and SIGKILL. Our private clusters keep
#: nothing that a graceful exit would save (shards are stopped first; the temp dir is removed):
#: on SIGTERM the dashboard's processes end within 2 s, the raylet after ~11 s, and the GCS
#: server and autoscaler monitor not within 15 s (Ray 2.60, 2026-12-06), so a longer grace
#: only made every stop wait (13 s of the demo's).
STOP_GRACE_S = 2.0


class LocalRay:
    """A local Ray head in a private temp dir, with the shards of ``kvblend server``.

    Args:
        server_args: more ``kvblend server`` flags (sizes, paths; never secrets: those go in
            ``env``).
        env: variables for ``kvblend server``/``stop`` (``KVBLEND_*``, credentials); copied
            into :attr:`env`, with the address added once started.

    Use :meth:`start` and :meth:`stop` (idempotent).
    """

    def __init__(self, server_args: tuple[str, ...] | list[str] = (), env: dict[str, str] | None = None) -> None:
        self.server_args = list(server_args)
        self.env: dict[str, str] = dict(env or {})
        self.address = ""
        self.dashboard_url = ""
        self.shards: list[str] = []
        # short, under /tmp: Ray puts its sockets below it (a socket path has at most 107 bytes)
        self.temp_dir = tempfile.mkdtemp(prefix="kvbray-", dir="/tmp")

    def start(self, timeout_s: float = 600.0) -> LocalRay:
        """Run ``kvblend server --address local --temp-dir DIR`` (free ports for the head's GCS
        unless ``--port`` is given, the dashboard unless ``--no-dashboard`` or ``--dashboard-port``
        is, and the Ray Client server);
        sets :attr:`address`, :attr:`dashboard_url` ("" without one), :attr:`shards`, and
        ``RAY_ADDRESS`` and ``KVBLEND_RAY_ADDRESS`` in :attr:`env`.

        Raises:
            RuntimeError: ``kvblend server`` failed (its output in the message).
            subprocess.TimeoutExpired: it ran past ``timeout_s``.
        """
        ports = ["--ray-client-server-port", str(free_port())]
        if "--port" not in self.server_args:  # a private head: never the machine's fixed port
            ports += ["--port", str(free_port())]
        if not {"--no-dashboard", "--dashboard-port"} & set(self.server_args):
            ports += ["--dashboard-port", str(free_port())]
        r = kvblend_cli("server", "--address", "local", "--temp-dir", self.temp_dir, *ports, *self.server_args,
                        env=self.env, timeout_s=timeout_s)
        started = json.loads(r.stdout.strip().splitlines()[-1])
        self.address, self.shards = started["address"], list(started["shards"])
        url = started.get("dashboard_url") or ""
        self.dashboard_url = url if not url or "://" in url else f"http://{url}"
        # Ray's tools read RAY_ADDRESS; kvblend's config (ray_address) reads KVBLEND_RAY_ADDRESS
        self.env.update(RAY_ADDRESS=self.address, KVBLEND_RAY_ADDRESS=self.address)
        log.info("local Ray at %s (temp dir %s), shards %s", self.address, self.temp_dir, self.shards)
        return self

    def stop(self, timeout_s: float = 600.0) -> int:
        """This process's connection to this cluster first (else the raylet's exit looks like a
        crash to it; a connection to another cluster is left alone), the shards (``kvblend
        stop``), then this cluster's processes. Returns how many processes were ended; the
        temp dir is removed."""
        import ray

        if self.address and ray.is_initialized():
            with contextlib.suppress(Exception):  # noqa: BLE001 - connected elsewhere, or half down
                if ray.get_runtime_context().gcs_address == self.address:
                    ray.shutdown()
        if self.address:
            kvblend_cli("stop", check=False, env=self.env, timeout_s=timeout_s)
        n = end_ray_node(self.temp_dir, self.address)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.address = ""
        return n


def ray_node_processes(temp_dir: str, address: str = "") -> list:
    """The ``psutil.Process`` of this user's Ray processes of the node started with
    ``--temp-dir temp_dir`` (an argument that is ``temp_dir``, ends with ``=temp_dir`` or holds a
    path below it: GCS, raylet, dashboard, log monitor, ...) or, when ``address`` is given, an
    argument ending with ``=address`` (the Ray Client server, which names neither), and their
    children (the workers, whose titles name neither). A process is Ray's when an argument is
    a path with a ``/ray/`` part or a ``ray.``/``ray::`` module or title. This process and its
    parents are never listed. Without ``address``, the one ``ray start --head`` wrote in
    ``temp_dir/ray_current_cluster`` (if any) is used."""
    import psutil

    if not address:
        with contextlib.suppress(OSError):
            with open(os.path.join(temp_dir, "ray_current_cluster")) as fh:
                address = fh.read().strip()
    spared = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    uid = os.getuid()

    def names_node(argv: list[str]) -> bool:
        return any(a == temp_dir or a.endswith("=" + temp_dir) or temp_dir + "/" in a
                   or (address and a.endswith("=" + address)) for a in argv)

    def is_ray(argv: list[str]) -> bool:
        return any("/ray/" in a or a.startswith(("ray.", "ray::")) for a in argv)

    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline", "uids"]):
        with contextlib.suppress(psutil.Error):
            argv = p.info["cmdline"] or []
            if p.info["uids"].real == uid and names_node(argv) and is_ray(argv):
                found[p.pid] = p
                found.update({c.pid: c for c in p.children(recursive=True)})
    for pid in spared:
        found.pop(pid, None)
    return list(found.values())


def end_ray_node(temp_dir: str, address: str = "", grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM the processes of :func:`ray_node_processes`, SIGKILL those alive after
    ``grace_s`` seconds; returns how many there were. Other Ray clusters on the machine are
    not touched."""
    import psutil

    procs = ray_node_processes(temp_dir, address)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)
    return len(procs)


def stop_hint(cluster: LocalRay) -> str:
    """The commands that end ``cluster`` (its shards, then its processes) from a shell."""
    return (f"kvblend stop --address {cluster.address} && {sys.executable} -m cluster.workloads.local_ray "
            f"stop {cluster.temp_dir} {cluster.address}")


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.workloads.local_ray stop DIR [ADDRESS]``: end the processes of the
    private cluster in ``DIR`` (see :func:`end_ray_node`) and remove ``DIR``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m cluster.workloads.local_ray")
    sub = p.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="end one private local Ray cluster (never another)")
    stop.add_argument("temp_dir")
    stop.add_argument("address", nargs="?", default="")
    args = p.parse_args(argv)
    n = end_ray_node(os.path.abspath(args.temp_dir), args.address)
    shutil.rmtree(args.temp_dir, ignore_errors=True)
    print(f"ended {n} process(es) of the Ray cluster in {args.temp_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
