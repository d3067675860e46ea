"""One factory for the cache client every caller uses (connector, ingest, demo, benchmarks).

:func:`make_client` returns the Ray :class:`~cluster.cache.client.CacheClient` when Ray and at
least one shard are reachable, else the machine-local
:class:`~cluster.cache.local.LocalCacheClient` (one warning per process).
"""

from __future__ import annotations

from cluster.cache.connect import connect, warn_once
from cluster.cache.lifecycle import shard_names


def make_client(config, namespace: str | None = None, **kwargs):
    """A :class:`~cluster.cache.client.CacheClient` when Ray and at least one shard are reachable,
    else a :class:`~cluster.cache.local.LocalCacheClient` (with one warning per process).

    Args:
        config: a :class:`cluster.config.KVBlendConfig`.
        namespace: the chunk namespace digest this client reads and writes (for ``clear``).
    """
    from cluster.cache.local import local_client

    device = kwargs.get("device", "cpu")
    ray = connect(config.cluster)
    if ray is None:
        warn_once("kvblend: Ray is not reachable at ray_address=%r; running without the "
                  "shared cache (a machine-local disk cache only)", config.cluster.ray_address)
        return local_client(config, device=device)
    if not shard_names(config.cluster.ray_namespace):
        warn_once("kvblend: no cache shards in Ray namespace %r (run `kvblend server`); "
                  "running without the shared cache (a machine-local disk cache only)",
                  config.cluster.ray_namespace)
        return local_client(config, device=device)
    from cluster.cache.client import CacheClient

    return CacheClient(config, namespace, **kwargs)
