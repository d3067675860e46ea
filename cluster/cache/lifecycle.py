"""Shard actors' lifecycle: their names, starting them on the cache nodes, finding and stopping them.

A shard is a detached, named Ray actor (:class:`cluster.cache.shard.CacheShard`) pinned to one
node that advertises ``shard_resource``: ``kvblend-shard-<node name>@<node_id[:8]>-<i>`` in the Ray
namespace ``ray_namespace``. :func:`start_shards` creates them idempotently
(``get_if_exists``; Ray restarts them, ``max_restarts=-1``; ``kvblend server``, tests,
benchmarks), :func:`shard_names` and :func:`get_shard` find them (the client's
:class:`~cluster.cache.router.ShardRouter`, the client factory, ``kvblend status``/``clear``),
:func:`stop_shards` kills them (``kvblend stop``, benchmarks), optionally after draining their
chunks to Redis/S3. Stopping keeps stored data: disk files, Redis and S3.

A shard is named ``kvblend-shard-<node name>@<node id>-<i>``: the Ray node id keeps actor names
unique among live nodes (a new id after every raylet or pod restart), the node name is a stable
identity of the machine (:mod:`cluster.cache.identity`). Its disk directory
(``<disk_root>/<node name>-<i>``) and its keys (placement hashes the name without the node id,
:func:`cluster.cache.placement.placement_name`) follow the node name, so a shard started on a
new Ray node of the same machine owns and finds the chunks of its predecessor, whose actor
:func:`start_shards` retires.
"""

from __future__ import annotations

import logging
import os
import time

from cluster.cache.placement import placement_name
from cluster.cache.shard import CacheShard

log = logging.getLogger("kvblend.shard")

SHARD_PREFIX = "kvblend-shard-"
#: custom-resource units one shard asks for (nodes advertise e.g. 1; up to 64 shards per node)
SHARD_RESOURCE_AMOUNT = 0.01


def shard_name(node_id: str, index: int, node_name: str | None = None) -> str:
    """``kvblend-shard-<node name>@<first 8 hex of the Ray node id>-<index>``, or without a node
    name ``kvblend-shard-<8 hex>-<index>``. Placement hashes the name without ``@<node id>``
    (:func:`cluster.cache.placement.placement_name`): stable across Ray node restarts."""
    if node_name:
        return f"{SHARD_PREFIX}{node_name}@{node_id[:8]}-{index}"
    return f"{SHARD_PREFIX}{node_id[:8]}-{index}"


def shard_node_id(name: str) -> str:
    """The 8 hex digits of the Ray node id in a shard's name (either naming scheme)."""
    rest = name.removeprefix(SHARD_PREFIX)
    return rest.rsplit("@", 1)[1].rsplit("-", 1)[0] if "@" in rest else rest.rsplit("-", 1)[0]


def _this_node_name() -> str:
    from cluster.cache.identity import node_name

    return node_name()


def node_names(node_ids: list[str], timeout_s: float = 30.0) -> dict[str, str | None]:
    """Each Ray node's stable name (:func:`cluster.cache.identity.node_name`, read by a tiny task
    pinned to it: only the node's own processes see its ``KVBLEND_NODE_NAME``); None for a
    node that did not answer within ``timeout_s`` (its shards keep node-id names)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    out: dict[str, str | None] = dict.fromkeys(node_ids)
    try:
        probe = ray.remote(num_cpus=0, max_retries=0)(_this_node_name)
        refs = {nid: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote()
                for nid in node_ids}
    except Exception as e:  # noqa: BLE001 - shards named by node id, as before node names
        log.warning("could not ask the nodes for their names (%s); shards are named by node id", e)
        return out
    deadline = time.monotonic() + timeout_s
    for nid, ref in refs.items():
        try:
            out[nid] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - fall back to the node id
            log.warning("node %s did not report its name (%s); its shards are named by node id", nid[:8], e)
            out[nid] = None
    return out


def _retire_predecessors(name: str, existing: list[str], alive_ids: set[str], namespace: str) -> None:
    """Kill shards of ``name``'s placement name left on Ray nodes that are gone (a restarted
    raylet or pod): otherwise placement would still count them, and send their keys nowhere."""
    import ray

    for other in existing:
        if other == name or placement_name(other) != placement_name(name):
            continue
        if shard_node_id(other) in alive_ids:
            log.warning("shards %s and %s share the node name: set KVBLEND_NODE_NAME per cache node", other, name)
            continue
        h = get_shard(other, namespace)
        if h is not None:
            try:
                ray.kill(h, no_restart=True)
                log.info("shard %s replaces %s (its Ray node is gone)", name, other)
            except Exception as e:  # noqa: BLE001 - it is gone already
                log.debug("could not kill %s: %s", other, e)


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
    nodes = [n for n in ray.nodes() if n.get("Alive") and (
        not c.shard_resource or n.get("Resources", {}).get(c.shard_resource, 0) > 0)]
    names_by_node = node_names([n["NodeID"] for n in nodes], min(timeout_s, 30.0))
    alive_ids = {n["NodeID"][:8] for n in ray.nodes() if n.get("Alive")}
    try:
        existing = shard_names(c.ray_namespace)
    except Exception as e:  # noqa: BLE001 - no predecessors retired this time
        log.warning("could not list the shards of %s (%s)", c.ray_namespace, e)
        existing = []
    for node in nodes:
        node_id = node["NodeID"]
        # The resource marks eligible nodes; placement itself is the node affinity. Each shard
        # asks for a token amount only, so several deployments (Ray namespaces) can share nodes.
        amount = {c.shard_resource: SHARD_RESOURCE_AMOUNT} if c.shard_resource else {}
        for i in range(c.shards_per_node):
            name = shard_name(node_id, i, names_by_node.get(node_id))
            _retire_predecessors(name, existing, alive_ids, c.ray_namespace)
            handles[name] = actor_cls.options(
                name=name, namespace=c.ray_namespace, lifetime="detached", get_if_exists=True,
                max_restarts=-1, max_task_retries=0, max_concurrency=16, num_cpus=0,
                resources=amount,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(name, config.tiers, disk_root, c.metrics, dict(env_vars or {}), index=i)
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
        if node is not None and shard_node_id(name) != node[:8]:
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
