"""``LocalTransport``: a tier in this process — the machine-local cache, no Ray, no threads.

The :class:`~cluster.cache.ops.Transport` over any one :class:`~tiers.tier.Tier`: tests and the
blend benchmark use a memory tier or a :class:`~tiers.stack.TierStack`; :func:`local_client`
builds the machine-local disk cache that :func:`cluster.cache.factory.make_client` falls back to
when no Ray cluster is reachable (and that the cache agent's chain serves from while its agent
is down). :class:`LocalCacheClient` is the one :class:`~cluster.cache.client.CacheClient` over
one such transport. Every call runs in the caller's thread: ``fetch_layers``'s futures read
when their result is first asked for (:class:`~cluster.cache.ops.DeferredRead`), so layers a
blend never asks for (it fell back) are never read.

What a tier hands over, the client checks: a lookup hands over each object's first bytes (its
header: a corrupted or foreign one is a miss, counted ``read_errors``); ``objects`` reads each
whole object, ``checked`` when the tier checked it as it came (a :class:`~tiers.host.HostTier`
on entry, a :class:`~tiers.stack.TierStack` on every read), else its layers are checked as the
client reads them. Failure behaviour: as the protocol says — a missing, corrupted or foreign
object is a miss, counted in ``stats()['client']['read_errors']`` when it fails a check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from cluster.cache.client import DEFAULT_MAX_MAPPED_BYTES, CacheClient
from cluster.cache.ops import (
    ClearRequest,
    FlushRequest,
    KeysRequest,
    LookupAnswer,
    LookupHit,
    LookupRequest,
    ObjectsAnswer,
    ObjectsRequest,
    PutRequest,
    StatsRequest,
)
from tiers.format import HEADER_PROBE_BYTES
from tiers.host import HostTier
from tiers.host_layers import TierLayers
from tiers.tier import Tier


def local_client(config, device: str | torch.device = "cpu") -> LocalCacheClient:
    """The machine-local cache used when no Ray cluster is reachable.

    A :class:`~tiers.disk.DiskTier` in ``shared`` mode under ``<cache_dir>/local-cache`` (or
    ``disk_path``/local), so that every process of this machine — a vLLM engine's scheduler
    and worker processes, ``kvblend ingest`` — sees the chunks the others stored.
    """
    import os

    from cluster.config import cache_dir
    from tiers.disk import DiskTier

    root = config.tiers.disk_path or cache_dir(config)
    tier = DiskTier(os.path.join(root, "local-cache"), int(config.tiers.disk_size_gib * 2**30),
                    config.tiers.eviction_policy, name="disk", shared=True,
                    io_timeout_s=config.tiers.io_timeout_s)
    return LocalCacheClient(tier, device=device, compress=config.tiers.compression == "lz4")


class LocalTransport:
    """One tier in this process (see the module docstring).

    Args:
        tier: any :class:`~tiers.tier.Tier` (default: a 1 GiB :class:`~tiers.host.HostTier`);
            the transport owns it (:meth:`close` closes it).
        compress: puts carry lz4-compressed layers.
    """

    name = "local"
    counters = ()
    remote = False
    threaded = False
    keep_bytes = DEFAULT_MAX_MAPPED_BYTES

    def __init__(self, tier: Tier | None = None, compress: bool = False) -> None:
        self.tier = tier if tier is not None else HostTier(1 << 30)
        self.compress = compress

    def bind(self, host) -> None:
        """Nothing to count here: the client checks what the tier hands over."""

    @property
    def up(self) -> bool:
        return True

    def lookup(self, request: LookupRequest) -> LookupAnswer:
        """Each key's first :data:`~tiers.format.HEADER_PROBE_BYTES` (its prefix and header;
        the client parses and checks them), answered by the tier's name; of a
        :class:`~tiers.stack.TierStack`, the name of the tier holding the key (a cost-aware plan
        prices each chunk by its own tier)."""
        keys = list(request.keys)
        locate = getattr(self.tier, "locate", None)
        names = locate(keys) if callable(locate) else [self.tier.name] * len(keys)
        hits = []
        for key, name in zip(keys, names, strict=True):
            got = self.tier.get_ranges(key, [(0, HEADER_PROBE_BYTES)])
            buf = got[0] if got is not None else self.tier.get(key)  # small object: shorter than the probe
            name = name or self.tier.name
            hits.append(None if buf is None else LookupHit(name, buf, name))
        return LookupAnswer(tuple(hits))

    def objects(self, request: ObjectsRequest) -> ObjectsAnswer:
        objects, checked = [], []
        for key in request.keys:
            buf = self.tier.get(key)
            objects.append(None if buf is None else np.frombuffer(buf, dtype=np.uint8))
            checked.append(buf is not None and self._checked(key))
        return ObjectsAnswer(tuple(objects), tuple(checked))

    def _checked(self, key) -> bool:
        """Whether the tier checked ``key``'s object whole as it handed it over or took it in."""
        if callable(getattr(self.tier, "find", None)):  # a TierStack: get() validated it whole
            return True
        checked = getattr(self.tier, "checked_header", None)
        return checked is not None and checked(key) is not None

    def put(self, request: PutRequest, done: Callable[[bool], None]) -> bool:
        """Into the tier before returning (first object wins)."""
        done(bool(self.tier.put(request.key, request.obj)))
        return True

    def flush(self, request: FlushRequest) -> bool:
        """True at once: :meth:`put` wrote the tier before returning (a tier with background
        writes of its own, a :class:`~tiers.stack.TierStack`, is waited for by :meth:`close`)."""
        return True

    def contains(self, request: KeysRequest) -> tuple[bool, ...]:
        return tuple(self.tier.contains(list(request.keys)))

    def delete(self, request: KeysRequest) -> int:
        return int(self.tier.delete(list(request.keys)))

    def clear(self, request: ClearRequest) -> int:
        """As a shard clears: a tier that clears by namespace (a ``TierStack``) does; one that
        lists its keys (host, disk) deletes those of the namespace (none with ``stale``: they
        hold objects of this version only); another clears nothing."""
        clear = getattr(self.tier, "clear", None)
        if callable(clear):
            return int(clear(request.namespace, stale=request.stale))
        keys = getattr(self.tier, "keys", None)
        if request.stale or not callable(keys):
            return 0
        stale = [k for k in keys() if request.namespace is None or k.namespace == request.namespace]
        return int(self.tier.delete(stale)) if stale else 0

    def stats(self, request: StatsRequest) -> dict:
        """``{'tiers': {tier name: tier.stats()}}``: its own cumulative counters and current
        ``bytes_used``/``capacity_bytes``/``num_chunks`` (see :meth:`tiers.tier.Tier.stats`)."""
        return {"tiers": {self.tier.name: self.tier.stats()}}

    def host_layers(self) -> TierLayers:
        """Where :class:`tiers.staging.StagedSource` copies layers from: the tier itself
        (checksums as :class:`tiers.host_layers.TierLayers` says)."""
        return TierLayers(self.tier)

    def close(self) -> None:
        """Close the tier when it has a ``close`` (a :class:`~tiers.stack.TierStack` flushes its
        background writes, then stops its threads; Redis and S3 tiers close their connections)."""
        closer = getattr(self.tier, "close", None)
        if closer is not None:
            closer()


class LocalCacheClient(CacheClient):
    """The :class:`~cluster.cache.client.CacheClient` over one :class:`LocalTransport`.

    Args:
        tier: any :class:`~tiers.tier.Tier` (default: a 1 GiB :class:`~tiers.host.HostTier`);
            the client owns it from now on (:meth:`close` closes it).
        device: device of tensors returned by ``fetch_layer``.
        compress: store objects with lz4-compressed layers.
    """

    def __init__(self, tier: Tier | None = None, device: str | torch.device = "cpu",
                 compress: bool = False) -> None:
        super().__init__(None, None, device, transports=[LocalTransport(tier, compress)])

    @property
    def tier(self) -> Tier:
        """The tier this client reads and writes."""
        return self.transports[0].tier
