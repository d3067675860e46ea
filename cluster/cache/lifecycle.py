"""Shard actors' lifecycle: their names, starting them on the cache nodes, finding and stopping them.

A shard is a detached, named Ray actor (:class:`cluster.cache.shard.CacheShard`) pinned to one
node that advertises ``shard_resource``: ``kvblend-shard-<node_id[:8]>-<i>`` in the Ray
namespace ``ray_namespace``. :func:`start_shards` creates them idempotently
(``get_if_exists``; Ray restarts them, ``max_restarts=-1``; ``kvblend server``, tests,
benchmarks), :func:`shard_names` and :func:`get_shard` find them (the client's
:class:`~cluster.cache.router.ShardRouter`, the client factory, ``kvblend status``/``clear``),
:func:`stop_shards` kills them (``kvblend stop``, benchmarks), optionally after draining their
chunks to Redis/S3. Stopping keeps stored data: disk files, Redis and S3.
"""

from __future__ import annotations

import logging
import os

from cluster.cache.shard import CacheShard

log = logging.getLogger("kvblend.shard")

SHARD_PREFIX = "kvblend-shard-"
#: custom-resource units one shard asks for (nodes advertise e.g. 1; up to 64 shards per node)
SHARD_RESOURCE_AMOUNT = 0.01


def shard_name(node_id: str, index: int) -> str:
    """``kvblend-shard-<first 8 hex of the Ray node id>-<index>``."""
    return f"{SHARD_PREFIX}{node_id[:8]}-{index}"


def shard_names(namespace: str) -> list[str]:
    """Names of the shard actors registered in ``namespace`` (alive or restarting)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == namespace and a["name"].startswith(SHARD_PREFIX))


def get_shard(name: str, namespace: str):
    """The actor handle of a named shard, or None when it does not exist."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def start_shards(config, timeout_s: float = 60.0, env_vars: dict[str, str] | None = None) -> list[str]:
    """Create (idempotently) the shard actors on every alive node with ``shard_resource``.

    Args:
        config: a :class:`cluster.config.KVBlendConfig`; Ray must be initialised.
        timeout_s: how long to wait for every shard's ``ready()``.
        env_vars: environment of newly created shard processes, e.g. S3 credentials when the
            nodes' own environment lacks them; the standard AWS chain (node environment,
            instance/IRSA roles) is used otherwise. They travel as a constructor argument
            (:class:`CacheShard` sets them before opening its tiers), never as a Ray
            ``runtime_env``: ``ray list actors --detail`` and the dashboard show a runtime env,
            not constructor arguments. The Redis URL (and its password) travels the same way,
            inside ``config.tiers`` (whose repr masks it).

    Returns:
        The names of the shards that answered ``ready()``.

    Raises:
        RuntimeError: no node advertises ``shard_resource``.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.config import cache_dir

    c = config.cluster
    disk_root = config.tiers.disk_path or os.path.join(cache_dir(config), "disk")
    actor_cls = ray.remote(CacheShard)
    handles = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        if c.shard_resource and res.get(c.shard_resource, 0) <= 0:
            continue
        node_id = node["NodeID"]
        # The resource marks eligible nodes; placement itself is the node affinity. Each shard
        # asks for a token amount only, so several deployments (Ray namespaces) can share nodes.
        amount = {c.shard_resource: SHARD_RESOURCE_AMOUNT} if c.shard_resource else {}
        for i in range(c.shards_per_node):
            name = shard_name(node_id, i)
            handles[name] = actor_cls.options(
                name=name, namespace=c.ray_namespace, lifetime="detached", get_if_exists=True,
                max_restarts=-1, max_task_retries=0, max_concurrency=16, num_cpus=0,
                resources=amount,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(name, config.tiers, disk_root, c.metrics, dict(env_vars or {}))
    if not handles:
        raise RuntimeError(f"no alive Ray node advertises the resource {c.shard_resource!r}; start "
                           f"nodes with --resources '{{\"{c.shard_resource}\": 1}}'")
    ready = {name: h.ready.remote() for name, h in handles.items()}
    names = []
    for name, ref in ready.items():
        try:
            ray.get(ref, timeout=timeout_s)
            names.append(name)
        except Exception as e:  # noqa: BLE001 - report, keep the others
            log.warning("shard %s not ready: %s", name, e)
    return sorted(names)


def stop_shards(namespace: str, node: str | None = None, drain: bool = False,
                timeout_s: float = 300.0) -> list[str]:
    """Kill the shard actors in ``namespace`` (no restart), optionally only those of ``node``
    and after :meth:`CacheShard.drain_to_shared`; returns their names. A shard that fails to
    drain is still stopped (its chunks then become misses) and the failure is logged."""
    import ray

    stopped = []
    for name in shard_names(namespace):
        if node is not None and not name.startswith(f"{SHARD_PREFIX}{node[:8]}-"):
            continue
        h = get_shard(name, namespace)
        if h is None:
            continue
        if drain:
            try:
                n = ray.get(h.drain_to_shared.remote(timeout_s), timeout=timeout_s + 30)
                log.info("%s: drained %d chunk(s) to the shared tiers", name, n)
            except Exception as e:  # noqa: BLE001 - stop anyway
                log.warning("could not drain %s: %s", name, e)
        try:
            ray.kill(h, no_restart=True)
            stopped.append(name)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            log.warning("could not stop %s: %s", name, e)
    return stopped
