"""One factory for the cache client every caller uses (the vLLM connector, ingest, the demo,
benchmarks).

:func:`make_client` returns the Ray :class:`~cluster.cache.client.CacheClient` when Ray and at
least one shard are reachable; otherwise it falls back, never failing the caller:

================================  ==============================================================
Ray not reachable                 machine-local client (one warning per process)
no shards in the Ray namespace    machine-local client (one warning per process)
building the client raised        machine-local client, with a warning naming the error
machine-local disk cache failed   in-memory :class:`~cluster.cache.local.LocalCacheClient`
                                  (1 GiB, this process only), with a warning naming the error
================================  ==============================================================

The machine-local client (:func:`cluster.cache.local.local_client`, a shared disk cache) is
made once per namespace digest and device in this process and shared by every caller: a vLLM
engine's scheduler and worker connectors live in one process on the CPU backend and must see
the same chunks even when the disk cache could not be opened. Callers therefore never
``close()`` a client this factory returned unless it is a ``CacheClient``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.cache.connect import connect, warn_once
from cluster.cache.lifecycle import shard_names
from cluster.cache.local import LocalCacheClient, local_client

if TYPE_CHECKING:
    from cluster.cache.protocol import CacheClientProtocol

log = logging.getLogger("kvblend.client")

_local_clients: dict[tuple[str | None, str], LocalCacheClient] = {}
_local_lock = threading.Lock()


def make_client(config, namespace: str | None = None, *, device: str = "cpu",
                thread_initializer: Callable[[], None] | None = None) -> CacheClientProtocol:
    """The cache client of this process (see the module docstring for the fallbacks).

    Args:
        config: a :class:`cluster.config.KVBlendConfig`.
        namespace: the chunk namespace digest this client reads and writes (for ``clear``, and
            the key under which a machine-local client is shared).
        device: device of the tensors ``fetch_layer`` returns.
        thread_initializer: run at the start of each of the Ray client's threads
            (:func:`cluster.vllm.affinity.unpin_thread` inside a vLLM CPU worker).

    Returns:
        A :class:`~cluster.cache.client.CacheClient` or a shared
        :class:`~cluster.cache.local.LocalCacheClient`; both keep
        :class:`cluster.cache.protocol.CacheClientProtocol`. A broken or unreachable cache raises nothing.
    """
    try:
        ray = connect(config.cluster)
        if ray is None:
            warn_once("kvblend: Ray is not reachable at ray_address=%r; running without the "
                      "shared cache (a machine-local disk cache only)", config.cluster.ray_address)
        elif not shard_names(config.cluster.ray_namespace):
            warn_once("kvblend: no cache shards in Ray namespace %r (run `kvblend server`); "
                      "running without the shared cache (a machine-local disk cache only)",
                      config.cluster.ray_namespace)
        else:
            from cluster.cache.client import CacheClient

            return CacheClient(config, namespace, device=device, thread_initializer=thread_initializer)
    except Exception as e:  # noqa: BLE001 - no shared cache is a degraded mode, not an error
        log.warning("kvblend: cache client unavailable (%s: %s); using a local cache", type(e).__name__, e)
    return shared_local_client(config, namespace, device=device)


def shared_local_client(config, namespace: str | None = None, *, device: str = "cpu") -> LocalCacheClient:
    """This process's machine-local client for ``namespace`` and ``device`` (made on the first
    call: the shared disk cache, or an in-memory one when that cannot be opened)."""
    with _local_lock:
        client = _local_clients.get((namespace, str(device)))
        if client is None:
            try:
                client = local_client(config, device=device)
            except Exception as e:  # noqa: BLE001 - a cache in memory still serves this process
                log.warning("kvblend: cache client unavailable (%s: %s); using a local cache",
                            type(e).__name__, e)
                client = LocalCacheClient(device=device)
            _local_clients[(namespace, str(device))] = client
        return client
