"""Pick the cache client for this process: the Ray-sharded cluster, or a local one.

A process that cannot reach Ray runs without the shared cache (an in-process
:class:`~cluster.client_api.LocalCacheClient`), with one warning.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvblend.clients")
_warned = False


def open_client(config, namespace, device: str = "cpu"):
    """A connected :class:`cluster.client.CacheClient`, or a ``LocalCacheClient`` fallback."""
    global _warned
    try:
        from cluster.client import CacheClient
        from cluster.ray_util import connect

        if connect(config) is not None:
            return CacheClient(config, namespace, device=device)
        reason = f"no Ray cluster at ray_address={config.cluster.ray_address!r}"
    except Exception as e:  # noqa: BLE001 - any failure means: no shared cache
        reason = f"{type(e).__name__}: {e}"
    from cluster.client_api import LocalCacheClient

    if not _warned:
        log.warning("kvblend: shared cache unavailable (%s); using a cache local to this process", reason)
        _warned = True
    return LocalCacheClient(device=device)
