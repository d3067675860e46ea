"""One factory for the cache client every caller uses (the vLLM connector, ingest, the demo,
benchmarks): the one :class:`~cluster.cache.client.CacheClient` over the transport chain it picks.

:func:`make_client` with ``agent=True`` (the vLLM connector's ``ray_client: agent``) gives the
chain *cache agent, then machine-local cache* (:func:`agent_client`; the agent's
:class:`~cluster.cache.agent_transport.AgentTransport` serves while an agent is up, the shared
``local_fallback`` client's transport while it is down). Otherwise it returns a client over the
:class:`~cluster.cache.ray_transport.RayTransport` (shard actors from this process) when Ray and
at least one shard are reachable; else it falls back:

================================  ==============================================================
Ray not reachable                 machine-local client (one warning per process)
no shards in the Ray namespace    machine-local client (one warning per process)
building the client raised        ``fallback_on_error=True`` (the vLLM connector: a request never
                                  fails because the cache did): machine-local client, with a
                                  warning naming the error; else the error reaches the caller
                                  (``kvblend ingest``/``demo``: a malformed ``ray_address`` is a
                                  ``ValueError`` the CLI prints)
``local_fallback`` not ``disk``   ``memory``: a 1 GiB in-memory client of this process; ``off``: a
                                  client that stores nothing (every read a miss)
machine-local disk cache failed   ``fallback_on_error=True``: in-memory
                                  :class:`~cluster.cache.local.LocalCacheClient` (1 GiB, this
                                  process only), with a warning; else the error is raised
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

from cluster.cache.client import CacheClient
from cluster.cache.connect import ObjectKeyMissing, connect, warn_once
from cluster.cache.lifecycle import shard_names
from cluster.cache.local import LocalCacheClient, local_client

if TYPE_CHECKING:
    from cluster.cache.protocol import CacheClientProtocol

log = logging.getLogger("kvblend.client")

_local_clients: dict[tuple[str | None, str], LocalCacheClient] = {}
_agent_clients: dict[tuple[str | None, str], CacheClient] = {}
_local_lock = threading.Lock()


def make_client(config, namespace: str | None = None, *, device: str = "cpu",
                thread_initializer: Callable[[], None] | None = None,
                fallback_on_error: bool = False, agent: bool = False) -> CacheClientProtocol:
    """The cache client of this process (see the module docstring for the fallbacks).

    Args:
        config: a :class:`cluster.config.KVBlendConfig`.
        namespace: the chunk namespace digest this client reads and writes (for ``clear``, and
            the key under which a machine-local client is shared).
        device: device of the tensors ``fetch_layer`` returns.
        thread_initializer: run at the start of each of the Ray client's threads
            (:func:`cluster.vllm.affinity.unpin_thread` inside a vLLM CPU worker).
        fallback_on_error: degrade to a machine-local (or in-memory) client when building the
            client raises, instead of raising (see the module docstring).
        agent: (vLLM connectors with ``ray_client='agent'``) Ray runs in a child process:
            the agent chain (:func:`shared_agent_client`), one per namespace and device in this
            process; ignored with ``ray_address='local'`` (an in-process cluster).

    Returns:
        A :class:`~cluster.cache.client.CacheClient` (over the agent chain, or the Ray
        transport), or a shared :class:`~cluster.cache.local.LocalCacheClient`; each keeps
        :class:`cluster.cache.protocol.CacheClientProtocol`.

    Raises:
        ValueError: a malformed ``ray_address`` (only without ``fallback_on_error``); likewise
            whatever building the Ray or the machine-local client raised.
        cluster.cache.connect.ObjectKeyMissing: no object key here while the cluster signs
            its chunk objects (even with ``fallback_on_error``: the process refuses to start).
    """
    if agent and config.cluster.ray_address != "local":
        return shared_agent_client(config, namespace, device=device, thread_initializer=thread_initializer)
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
            return CacheClient(config, namespace, device=device, thread_initializer=thread_initializer)
        return shared_local_client(config, namespace, device=device, memory_fallback=fallback_on_error)
    except Exception as e:  # noqa: BLE001 - no shared cache is a degraded mode, not an error
        if not fallback_on_error or isinstance(e, ObjectKeyMissing):  # a keyless process refuses to start
            raise
        log.warning("kvblend: cache client unavailable (%s: %s); using a local cache", type(e).__name__, e)
    return shared_local_client(config, namespace, device=device, memory_fallback=True)


def shared_agent_client(config, namespace: str | None = None, *, device: str = "cpu",
                        thread_initializer: Callable[[], None] | None = None) -> CacheClient:
    """This process's agent-chain client for ``namespace`` and ``device`` (made, and its first
    agent started, on the first call; :func:`agent_client` over the shared ``local_fallback``
    client)."""
    with _local_lock:
        client = _agent_clients.get((namespace, str(device)))
    if client is None:
        fallback = shared_local_client(config, namespace, device=device, memory_fallback=True)
        made = agent_client(config, namespace, fallback, device=device, thread_initializer=thread_initializer)
        with _local_lock:
            client = _agent_clients.setdefault((namespace, str(device)), made)
        if client is not made:
            made.close()
    return client


def agent_client(config, namespace: str | None, fallback: CacheClient | None = None, *,
                 device: str = "cpu", thread_initializer: Callable[[], None] | None = None,
                 start_timeout_s: float | None = None) -> CacheClient:
    """A client over the chain *cache agent, then* ``fallback``'s transports (which it does not
    close: the fallback is shared; default: a 1 GiB in-memory cache of its own).

    Args:
        start_timeout_s: how long to wait for the first agent
            (:data:`~cluster.cache.agent_life.AGENT_START_TIMEOUT_S` by default).

    Raises:
        ObjectKeyMissing: the first agent found that the cluster signs its chunk objects and
            this process has no key (issue 37: the vLLM process refuses to start).
    """
    from cluster.cache.agent_transport import AGENT_START_TIMEOUT_S, AgentTransport

    agent = AgentTransport(config, namespace, start_timeout_s=(
        AGENT_START_TIMEOUT_S if start_timeout_s is None else start_timeout_s))
    borrowed = fallback.transports if fallback is not None else ()
    chain = [agent, *(borrowed or LocalCacheClient().transports)]
    return CacheClient(config, namespace, device, thread_initializer=thread_initializer,
                       transports=chain, borrowed=borrowed)


def shared_local_client(config, namespace: str | None = None, *, device: str = "cpu",
                        memory_fallback: bool = True) -> LocalCacheClient:
    """This process's machine-local client for ``namespace`` and ``device`` (made on the first
    call: the shared disk cache; with ``memory_fallback`` an in-memory one when that cannot be
    opened, else the error is raised)."""
    mode = config.cluster.local_fallback
    with _local_lock:
        client = _local_clients.get((namespace, str(device)))
        if client is None and mode != "disk":
            # 'memory': this process only; 'off': a tier of no capacity (every put refused,
            # every read a miss), e.g. in a vLLM pod whose container layer must not fill up
            from tiers.host import HostTier

            client = LocalCacheClient(HostTier(1 << 30 if mode == "memory" else 0), device=device)
            _local_clients[(namespace, str(device))] = client
        if client is None:
            try:
                client = local_client(config, device=device)
            except Exception as e:  # noqa: BLE001 - a cache in memory still serves this process
                if not memory_fallback:
                    raise
                log.warning("kvblend: cache client unavailable (%s: %s); using a local cache",
                            type(e).__name__, e)
                client = LocalCacheClient(device=device)
            _local_clients[(namespace, str(device))] = client
        return client
