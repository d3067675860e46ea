"""Connecting to (or starting) the Ray cluster that holds the cache shards.

``ray_address`` (see :class:`cluster.config.ClusterConfig`):

* ``'auto'``  — join the cluster named by ``$RAY_ADDRESS`` or the latest one started on this
  machine (:func:`ray_address_file`, ``/tmp/ray/ray_current_cluster`` by default); none
  running -> not connected.
* ``'local'`` — start a single-node Ray in this process, advertising the shard resource and
  with an object store of ``object_store_gib`` (set explicitly: Ray's default is 30% of RAM,
  7 GiB on a 24 GiB CI machine, more than a test or demo needs).
* ``host:port`` — join that cluster's GCS.

A process that cannot reach Ray gets ``None`` from :func:`connect` (after one TCP probe with a
short timeout, so an unreachable address costs ~1 s, not Ray's minute of retries); callers
then run without the shared cache (:func:`cluster.cache.factory.make_client` returns a
:class:`~cluster.cache.local.LocalCacheClient`) and log ONE warning per process
(:func:`warn_once`).

A process without an object key that joins a cluster whose ``kvblend server`` signs chunk
objects (:data:`OBJECT_AUTH_MARK`, :mod:`cluster.cli.object_key`) is refused
(:class:`ObjectKeyMissing`): it would write unsigned objects every shard refuses, and read
whatever anyone planted (issue 37).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import sys
import threading

log = logging.getLogger("kvblend.ray")

_warned = False
_warn_lock = threading.Lock()

#: Ray internal-KV key (in the deployment's Ray namespace): ``required`` or ``off``
OBJECT_AUTH_MARK = b"kvblend_object_auth"


class ObjectKeyMissing(ValueError):
    """This process has no object key while the cluster it joined signs its chunk objects (a
    setup mistake: the CLI prints it without a traceback)."""


def _probe(address: str, timeout_s: float = 1.0) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"ray_address={address!r}: expected 'auto', 'local' or host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def ray_address_file() -> str:
    """The file where Ray keeps the address of the newest cluster started on this machine, the
    one ``ray.init(address="auto")`` reads: ``ray_current_cluster`` in Ray's temp dir,
    ``$RAY_TMPDIR/ray``, else (Linux) ``$TMPDIR/ray``, else ``/tmp/ray`` (Ray 2.60's
    ``get_default_ray_temp_dir``, derived here: the agent's client never imports Ray)."""
    if os.environ.get("RAY_TMPDIR"):
        base = os.environ["RAY_TMPDIR"]
    elif sys.platform.startswith("linux") and os.environ.get("TMPDIR"):
        base = os.environ["TMPDIR"]
    else:
        base = "/tmp"
    return os.path.join(base, "ray", "ray_current_cluster")


def _auto_address() -> str | None:
    addr = os.environ.get("RAY_ADDRESS", "")
    if addr and addr not in ("auto", "local"):
        return addr
    try:
        with open(ray_address_file()) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def warn_once(message: str, *args) -> None:
    """Log ``message`` (``%``-formatted with ``args``) as a warning if no call of this
    function has logged in this process yet; later calls, whatever their message, log
    nothing (one "running without the shared cache" warning per process)."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    log.warning(message, *args)


@contextlib.contextmanager
def _unseeded_random():
    """Reseed Python's ``random`` from OS entropy for the block, then restore its state.

    Ray draws each driver's GCS pubsub subscriber id from ``random``. vLLM seeds ``random``
    identically in every worker (``seed=0``), so two replicas' workers joined Ray with the
    same error-subscriber id and each poll cancelled the other's: a busy loop of
    ``GcsSubscriberPoll`` (measured 2026-11-29 on 2 cores: GCS ~60% of a core, each idle
    worker ~20%, blends 3-5x slower). The caller's random sequence is left as it was.
    """
    state = random.getstate()
    random.seed()
    try:
        yield
    finally:
        random.setstate(state)


def connect(cluster_config, *, start_resources: dict[str, float] | None = None,
            include_dashboard: bool = False, dashboard_port: int | None = None,
            metrics_export_port: int | None = None, temp_dir: str | None = None):
    """Connect this process to Ray (once); returns the ``ray`` module, or None when unreachable.

    Args:
        cluster_config: a :class:`cluster.config.ClusterConfig`.
        start_resources: custom resources of the node when ``ray_address='local'`` starts one
            (default: ``{shard_resource: shards_per_node}``).
        include_dashboard, dashboard_port, metrics_export_port, temp_dir: for ``'local'`` only.

    Returns:
        ``ray`` when connected (or already initialised), else None (nothing raised).

    Raises:
        ValueError: a malformed ``ray_address``.
        ObjectKeyMissing: joined a cluster that signs its chunk objects without a key here
            (disconnected again; the message says where the key is expected).
    """
    import ray

    if ray.is_initialized():
        return ray
    cfg = cluster_config
    address = cfg.ray_address
    if address == "local":
        resources = start_resources
        if resources is None:
            resources = {cfg.shard_resource: float(cfg.shards_per_node)} if cfg.shard_resource else {}
        # address="local": always a new cluster (plain ray.init() would join one already
        # running on this machine, e.g. another deployment's)
        with _unseeded_random():
            ray.init(address="local", namespace=cfg.ray_namespace, resources=resources,
                     object_store_memory=int(cfg.object_store_gib * 2**30),
                     include_dashboard=include_dashboard, dashboard_port=dashboard_port,
                     _metrics_export_port=metrics_export_port, _temp_dir=temp_dir,
                     log_to_driver=False, configure_logging=False)
        return ray
    if address == "auto":
        address = _auto_address()
        if address is None:
            return None
    if not _probe(address):
        return None
    _token_auth_if_available()
    try:
        with _unseeded_random():
            ray.init(address=address, namespace=cfg.ray_namespace, log_to_driver=False,
                     configure_logging=False)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        log.debug("ray.init(%s) failed: %s", address, e)
        return None
    _check_object_key(ray, cfg.ray_namespace)
    return ray


def _check_object_key(ray, namespace: str) -> None:
    """Raise :class:`ObjectKeyMissing` (after disconnecting) when the cluster's mark says its
    chunk objects are signed and this process has no key."""
    from cluster.env import OBJECT_AUTH, missing_key_message, snapshot
    from tiers import auth

    if auth.current() is not None or snapshot().get(OBJECT_AUTH) == "off":
        return  # has a key, or was told explicitly to run without one (--no-object-auth)
    if _read_mark(namespace) == b"required":
        ray.shutdown()
        raise ObjectKeyMissing(missing_key_message(
            snapshot(), f"the kvblend cluster in Ray namespace {namespace!r} signs its chunk objects"))


def _read_mark(namespace: str) -> bytes | None:
    """The cluster's :data:`OBJECT_AUTH_MARK` in ``namespace`` (None: none, or unreadable)."""
    try:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(OBJECT_AUTH_MARK, namespace=namespace)
    except Exception as e:  # noqa: BLE001 - another Ray version: the shards still refuse keyless starts
        log.debug("object auth mark unreadable: %s", e)
        return None


def _token_auth_if_available() -> None:
    """Ray 2.60 starts clusters with token authentication on by default (``ray start`` and a
    local ``ray.init()`` create ``~/.ray/auth_token``), but a driver joining an existing
    cluster only sends the token when ``RAY_AUTH_MODE=token`` is set; without it the GCS
    answers ``InvalidAuthToken``. So when ``RAY_AUTH_MODE`` is unset and a token exists
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or the file), turn token mode on for this
    process (as Ray's own local start does). A token-mode driver also joins clusters that
    have authentication disabled (checked with Ray 2.60)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray version: leave authentication to the user's settings
        return
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception as e:  # noqa: BLE001 - best effort; ray.init reports real auth errors
        log.debug("token auth setup: %s", e)
