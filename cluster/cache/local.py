"""``LocalCacheClient``: the cache client over tiers in this process — no Ray, no threads.

It keeps the contract of :class:`cluster.cache.protocol.CacheClientProtocol` (the Ray
:class:`~cluster.cache.client.CacheClient` keeps the same one) over any one
:class:`~tiers.tier.Tier`: tests and the blend benchmark use a memory tier or a
:class:`~tiers.stack.TierStack`; :func:`local_client` builds the machine-local disk cache that
:func:`cluster.cache.factory.make_client` falls back to when no Ray cluster is reachable.
Every call runs synchronously in the caller's thread (``fetch_layer``'s future is already
done when returned). Failure behaviour: as the protocol says — a missing, corrupted or
foreign object is a miss, counted in ``stats()['client']['read_errors']`` when it fails to
decode.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from blend.protocols import ChunkMeta
from tiers.codec import encode_kv, layer_tensor
from tiers.format import HEADER_PROBE_BYTES, FormatError, decode_layer, parse_header
from tiers.host import HostTier
from tiers.host_layers import TierLayers
from tiers.keys import ChunkKey
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


class LocalCacheClient:
    """Cache client over one tier in this process (a
    :class:`~cluster.cache.protocol.CacheClientProtocol`).

    Args:
        tier: any :class:`~tiers.tier.Tier` (default: a 1 GiB :class:`~tiers.host.HostTier`); the client
            owns it from now on (:meth:`close` closes it).
        device: device of tensors returned by ``fetch_layer``.
        compress: store objects with lz4-compressed layers.
    """

    def __init__(self, tier: Tier | None = None, device: str | torch.device = "cpu",
                 compress: bool = False) -> None:
        self.tier = tier if tier is not None else HostTier(1 << 30)
        self.device = torch.device(device)
        self.compress = compress
        self._lock = threading.Lock()
        #: cumulative event counts since construction (see :meth:`stats`)
        self.counters = {"lookups": 0, "hits": 0, "misses": 0, "read_errors": 0, "puts": 0}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _header(self, key: ChunkKey):
        ranges = self.tier.get_ranges(key, [(0, HEADER_PROBE_BYTES)])
        if ranges is None:
            obj = self.tier.get(key)  # small object: shorter than the probe
            if obj is None:
                return None
            buf = obj
        else:
            buf = ranges[0]
        try:
            return parse_header(buf, expected_key=key)
        except FormatError:
            self._count("read_errors")
            return None

    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """Which keys the tier holds (header read and checked per key); ``tier`` of each
        :class:`ChunkMeta` is the tier's name (of a :class:`~tiers.stack.TierStack`: the tier
        holding the key, so a cost-aware plan prices each chunk by its own tier). Promotes nothing."""
        keys = list(keys)
        for key in keys:
            _check_key("lookup", key)
        out: list[ChunkMeta | None] = []
        locate = getattr(self.tier, "locate", None)  # a TierStack names the tier holding each key
        names = locate(keys) if callable(locate) else [self.tier.name] * len(keys)
        for key, name in zip(keys, names, strict=True):
            h = self._header(key)
            self._count("lookups")
            if h is None:
                self._count("misses")
                out.append(None)
            else:
                self._count("hits")
                out.append(ChunkMeta(key, h.num_tokens, tuple(h.position_list()), name or self.tier.name))
        return out

    def read_layer(self, key: ChunkKey, layer_idx: int) -> torch.Tensor | None:
        """Layer ``layer_idx`` of one chunk, ``[2, T, H, D]`` on ``device``, or None."""
        h = self._header(key)
        if h is None or not 0 <= layer_idx < h.num_layers:
            return None
        e = h.layers[layer_idx]
        got = self.tier.get_ranges(key, [(e.offset, e.stored_len)])
        if got is None:
            return None
        try:
            raw = decode_layer(h, layer_idx, got[0])
        except FormatError:
            self._count("read_errors")
            return None
        return layer_tensor(raw, h.layer_shape, h.dtype).to(self.device)

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future[list[torch.Tensor | None]]:
        """:meth:`read_layer` of each key, as a future that is already done.

        Raises:
            ValueError: ``layer_idx < 0``.
        """
        if layer_idx < 0:
            raise ValueError(f"layer_idx={layer_idx} must be >= 0")
        fut: Future = Future()
        fut.set_result([self.read_layer(k, layer_idx) for k in keys])
        return fut

    def fetch_layers(self, keys: Sequence[ChunkKey],
                     layer_idxs: Sequence[int]) -> list[Future[list[torch.Tensor | None]]]:
        """:meth:`fetch_layer` of each layer, as futures that read when their result is first
        asked for, in the asking thread (no threads here; layers never asked
        for are never read: a blend that falls back stops reading).

        Raises:
            ValueError: a negative layer index.
        """
        keys = list(keys)
        if any(i < 0 for i in layer_idxs):
            raise ValueError(f"layer_idxs {list(layer_idxs)} must be >= 0")
        return [DeferredRead(lambda i=i: self.fetch_layer(keys, i).result()) for i in layer_idxs]

    def host_layers(self) -> TierLayers:
        """Where :class:`tiers.staging.StagedSource` copies this client's layers from (the
        tier itself; checksums as :class:`tiers.staging.TierLayers` says)."""
        return TierLayers(self.tier)

    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> None:
        """Encode ``kv`` ``[L, 2, T, H, D]`` and put it into the tier (first object wins);
        raises ``TypeError``/``ValueError`` as the protocol says."""
        _check_key("put", key)
        self._count("puts")
        self.tier.put(key, encode_kv(key, kv, positions, compress=self.compress))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """True at once: :meth:`put` wrote the tier before returning (a tier with background
        writes of its own, a :class:`~tiers.stack.TierStack`, is waited for by :meth:`close`)."""
        return True

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """The tier's ``contains``."""
        return self.tier.contains(keys)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """The tier's ``delete``: how many keys were present."""
        return self.tier.delete(keys)

    def stats(self) -> dict:
        """``{'client': {name: count}, 'tiers': {tier name: tier.stats()}}``: ``client`` holds
        cumulative counts since construction (keys looked up, hit, missed; objects that failed
        to decode; puts); the tier's stats are its own cumulative counters and its current
        ``bytes_used``/``capacity_bytes``/``num_chunks`` (see :meth:`tiers.tier.Tier.stats`)."""
        with self._lock:
            client = dict(self.counters)
        return {"client": client, "tiers": {self.tier.name: self.tier.stats()}}

    def close(self) -> None:
        """Close the tier when it has a ``close`` (a :class:`~tiers.stack.TierStack` flushes
        its background writes, then stops its threads; Redis and S3 tiers close their
        connections); memory and disk tiers hold nothing to release."""
        closer = getattr(self.tier, "close", None)
        if closer is not None:
            closer()


class DeferredRead(Future):
    """A future whose work runs in the first thread that asks for its result."""

    def __init__(self, work) -> None:
        super().__init__()
        self._work = work
        self._run_lock = threading.RLock()  # done callbacks may ask again

    def result(self, timeout: float | None = None):
        with self._run_lock:
            if not self.done() and self.set_running_or_notify_cancel():
                try:
                    self.set_result(self._work())
                except BaseException as e:  # noqa: BLE001 - delivered through the future
                    self.set_exception(e)
        return super().result(timeout)


def _check_key(call: str, key: object) -> None:
    if not isinstance(key, ChunkKey):
        raise TypeError(f"{call} expects a ChunkKey, got {type(key).__name__}")
