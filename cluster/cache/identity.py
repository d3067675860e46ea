"""A shard's disk directory: named after a stable identity of its machine, locked while in use.

Why (issue #18 item 4): the shard *actor* is named after its Ray node id
(:func:`cluster.cache.lifecycle.shard_name`; actor names must be unique among live actors), but
the node id changes with every raylet or pod restart. A disk directory named after it was
orphaned by each restart: the new shard started empty while the old files kept their space
(an emptyDir pod then exceeded its limit, a hostPath filled up). The directory is instead
``<disk_root>/<node name>-<shard index>``, where the node name is

* ``$KVBLEND_NODE_NAME`` in the shard actor's environment: Ray actor processes inherit the
  environment of the ``ray start`` that started their raylet, so the variable is set where the
  node is started (the Helm chart sets it from the downward API: ``spec.nodeName`` for a
  hostPath disk, which outlives pods on that machine; the pod name otherwise, whose emptyDir
  survives container restarts); ``ray.cluster_utils.Cluster`` nodes get it through
  ``env_vars``;
* else the host name (``socket.gethostname()``: the pod name in Kubernetes, the machine's
  name elsewhere).

Read in the actor's own process, not by :func:`~cluster.cache.lifecycle.start_shards`: every
``kvblend server`` starts the shards of *all* nodes, and only the node's own processes know
its name. (A Ray node label would also reach the driver, but needs ``ray start --labels``
on every node, which KubeRay's generated command does not take from the environment.)

Two live shards must never share a directory (two shard pods with a hostPath disk scheduled
on one Kubernetes node have the same node name, anti-affinity being only preferred; so do two
deployments in other Ray namespaces sharing nodes and ``disk_path``). Each shard
takes an exclusive ``flock`` on ``<dir>/.kvblend-shard.lock`` for its lifetime; the kernel
drops it when the process dies, whatever the way (so before Ray restarts a dead shard: the
restarted one gets its directory back). A shard that finds the lock held tries
``<name>-<i>-b``, ``-c``, ... (all reused after restarts, whoever wins which). A file system
that cannot lock (some NFS) is used unlocked, with a warning.

Directories named after the actor (``kvblend-shard-<node id>-<i>``, before this scheme) are
not adopted: on a hostPath disk, delete them by hand after upgrading.

Names are sanitised to ``[0-9A-Za-z_.-]`` (other characters become ``_``, no ``..``, no
leading dot), at most :data:`MAX_NAME_CHARS` characters.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import string

log = logging.getLogger("kvblend.shard")

LOCK_FILE = ".kvblend-shard.lock"
MAX_NAME_CHARS = 200
#: directories a shard tries after ``<name>-<i>``: ``-b`` .. ``-z``
ALTERNATES = string.ascii_lowercase[1:]


def sanitize(raw: str) -> str:
    """``raw`` as a single, safe path component: ``[0-9A-Za-z_.-]``, no ``..``, no leading dot.

    Raises:
        ValueError: nothing usable is left (empty or only separators).
    """
    name = re.sub(r"[^0-9A-Za-z_.-]", "_", raw.strip())
    name = re.sub(r"\.{2,}", "_", name).lstrip(".")[:MAX_NAME_CHARS]
    if not name.strip("_-."):
        raise ValueError(f"node name {raw!r} has no usable characters")
    return name


def node_name(environ: dict[str, str] | None = None) -> str:
    """The stable identity of this process's machine (module docstring), sanitised;
    ``environ`` defaults to this process's environment, read now (a shard's start-up)."""
    from cluster.env import node_name_override, snapshot

    raw = node_name_override(snapshot() if environ is None else environ) or socket.gethostname()
    return sanitize(raw)


def disk_dir_names(name: str, index: int) -> list[str]:
    """Directory names a shard tries, in order: ``<name>-<index>``, then ``-b`` .. ``-z``."""
    first = f"{name}-{index}"
    return [first] + [f"{first}-{c}" for c in ALTERNATES]


def claim_disk_dir(disk_root: str, name: str, index: int) -> tuple[str, int | None]:
    """Create and lock the first free directory of :func:`disk_dir_names` under ``disk_root``.

    Returns:
        ``(path, lock fd)``; the caller keeps the fd open while it uses the directory (closing
        it, or the process exiting, releases the lock). The fd is None where the file system
        cannot lock: then the first name is used, unlocked.

    Raises:
        RuntimeError: every candidate is locked by a live process.
        OSError: ``disk_root`` cannot be created or written.
    """
    for dirname in disk_dir_names(name, index):
        path = os.path.join(disk_root, dirname)
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                log.warning("disk directory %s is in use by another live shard; trying the next", path)
                continue
            log.warning("cannot lock %s (%s): using it unlocked", path, e)
            return path, None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())  # who holds it, for people
        return path, fd
    raise RuntimeError(f"all {1 + len(ALTERNATES)} disk directories for {name}-{index} under "
                       f"{disk_root} are locked by live shards")
