"""``CacheClient``: blend's KV source and sink over the Ray cache shards.

Who calls what (one request; the contract both clients keep is
:class:`cluster.cache.protocol.CacheClientProtocol`)::

    scheduler side   lookup(keys)                 one call per owning shard, all in parallel;
                                                  shards start promoting hits into host memory
    worker side      fetch_layer(keys, 0..L-1)    futures of [2, T, H, D] tensors
    after a request  put(key, kv[L, 2, T, H, D])  asynchronous, idempotent; flush(timeout_s)

Placement: rendezvous hashing (:mod:`cluster.cache.placement`) of ``str(ChunkKey)`` over the
shard actors of ``ray_namespace``, kept by a :class:`~cluster.cache.router.ShardRouter`
(re-read every :data:`~cluster.cache.router.REFRESH_S` s and after a failed call); keys whose
owner changes are misses (``placement_moves``). Puts: :class:`~cluster.cache.puts.ShardWriter`.

Reads: ``lookup`` returns each hit's header bytes, which the client parses and caches, so
per-layer reads need no metadata round trip. The first ``fetch_layer`` of a chunk this client
has not mapped asks the owning shards for the chunks' ``ObjectRef``\\ s (one ``get_refs`` call
per shard, in parallel), ``ray.get``\\ s the whole objects at once (zero-copy on the same node)
and keeps them mapped in an LRU bounded by ``max_mapped_bytes`` (each mapped object stays
pinned in the node's object store while mapped); every layer is then a slice and a
copy (its checksum was checked as the shard stored it). Refs are not returned by ``lookup`` (each returned ref costs Ray a borrower
registration: 16 refs added ~5 ms to a 1 ms call on the dev box) nor kept after mapping.

Failure behaviour: every shard call waits at most ``call_timeout_s`` (a lookup: its
:func:`~cluster.cache.deadline.lookup_wait_s`; a late shard's keys are misses); a timeout, a
dead or restarting shard, a lost object or a corrupted header is a miss (``None``) and a
counter, never an exception. A failed shard is skipped for
:data:`~cluster.cache.router.SUSPECT_S` seconds; meanwhile, and whenever its call fails, the
client reads the configured shared Redis/S3 tiers directly. Only caller mistakes raise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from blend.protocols import ChunkMeta, fetch_in_order
from cluster.cache.connect import connect
from cluster.cache.deadline import lookup_wait_s
from cluster.cache.headers import HeaderCache, HeaderEntry, own_header
from cluster.cache.host_layers import RayHostLayers
from cluster.cache.placement import Placement
from cluster.cache.puts import ShardWriter
from cluster.cache.router import ShardRouter
from tiers.codec import encode_kv, layer_tensor, object_layer
from tiers.format import ChunkHeader, FormatError, parse_header
from tiers.keys import ChunkKey
from tiers.lower import shared_tiers
from tiers.reader import read_header
from tiers.stack import TierStack

log = logging.getLogger("kvblend.client")

#: bytes of chunk headers remembered after lookups (LRU by :func:`cluster.cache.headers.entry_nbytes`,
#: ~20 KB for 32 layers of 256 tokens; 65536 headers were ~1.2 GiB); a forgotten one costs a parse.
MAX_CACHED_HEADER_BYTES = 64 << 20
#: Several clients share a node's object store (2 GiB by default): at 1 GiB each, two vLLM
#: workers' clients filled it and the shard's promotions from disk failed (the demo,
#: 2026-11-29: 3 of 16 requests fell back to full prefill). One request maps ~140 MB here.
DEFAULT_MAX_MAPPED_BYTES = 256 << 20

COUNTERS = ("lookups", "hits", "misses", "read_errors", "shard_errors", "timeouts", "direct_reads",
            "puts", "put_errors", "puts_dropped", "placement_moves", "layer_reads", "layer_misses")


class CacheClient:
    """Client of the shared cache (a :class:`~cluster.cache.protocol.CacheClientProtocol`).

    Args:
        config: a :class:`cluster.config.KVBlendConfig` (``ray_address``, ``ray_namespace``,
            ``call_timeout_s``, Redis/S3 URLs for the dead-shard path).
        namespace: chunk namespace digest this client works in (default for ``clear``).
        device: device of the tensors ``fetch_layer`` returns.
        max_mapped_bytes: bytes of chunk objects kept mapped between requests (LRU; the
            objects of one ``fetch_layer`` call are always mapped while it runs).
        thread_initializer: run first in each of the client's 4 fetch threads (the vLLM wing
            passes one that widens a CPU worker's one-core affinity); None runs nothing.

    Raises:
        ConnectionError: Ray is not reachable (use :func:`cluster.cache.factory.make_client` to
            fall back to a local cache instead).
    """

    def __init__(self, config, namespace: str | None = None, device: str | torch.device = "cpu",
                 max_mapped_bytes: int = DEFAULT_MAX_MAPPED_BYTES,
                 thread_initializer: Callable[[], None] | None = None) -> None:
        self.config = config
        self.namespace = namespace
        self.device = torch.device(device)
        self.timeout_s = config.cluster.call_timeout_s
        if connect(config.cluster) is None:
            raise ConnectionError(f"Ray is not reachable at ray_address={config.cluster.ray_address!r}")
        self._lock = threading.Lock()
        self._meta: HeaderCache = HeaderCache()  # ChunkKey -> HeaderEntry, oldest first
        # key -> (mapped object, its own header): a tier may re-encode a chunk (lz4 below
        # memory), so offsets come from the object's header, not the one a lookup returned
        self._objects: OrderedDict[ChunkKey, tuple[np.ndarray, ChunkHeader]] = OrderedDict()
        self.max_mapped_bytes = int(max_mapped_bytes)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvblend-client",
                                        initializer=thread_initializer)
        self._shared: list | None = None
        #: cumulative event counts since construction (see :meth:`stats`)
        self.counters = dict.fromkeys(COUNTERS, 0)
        #: the shard set: placement, handles, suspects (tests and benchmarks read its placement)
        self.router = ShardRouter(config.cluster.ray_namespace, self.timeout_s, self._count,
                                  self._placement_changed)
        self._writer = ShardWriter(self.router, self._count)
        self.router.refresh(force=True)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _fetch_timeout_s(self) -> float:
        """Seconds one ``fetch_layer`` read may take in all: the blend's ``load_timeout_s``
        (its reader waits no longer) or ``call_timeout_s``, whichever is longer."""
        blend = getattr(self.config, "blend", None)
        return max(self.timeout_s, getattr(blend, "load_timeout_s", 0.0) or 0.0)

    def _placement_changed(self, old: Placement | None, new: Placement | None) -> None:
        """Forget what this client knows of keys whose owner changed (they become misses)."""
        moved = []
        if old is not None and new is not None:
            with self._lock:
                moved = [k for k, e in self._meta.items() if new.owner(str(k)) != e.shard]
                for k in moved:
                    self._meta.pop(k, None)
                    self._objects.pop(k, None)
        self._count("placement_moves", len(moved))

    def _shared_tiers(self) -> list:
        if self._shared is None:
            tiers = shared_tiers(self.config.tiers)
            # _direct_layer reads through them as a stack: no promotion or writes between the
            # shared tiers (a reader's copy of an S3 hit into Redis is its owner's job)
            self._shared_stack = TierStack(tiers, write_down=(), promote=False) if tiers else None
            self._shared = tiers
        return self._shared

    # -- KVSource ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """Which keys are cached: one call per owning shard, issued in parallel.

        Returns:
            Per key a :class:`ChunkMeta` (``tier`` = where it was found) or None. Never
            raises for cache faults (see module docstring).
        Raises:
            TypeError: a key that is not a :class:`ChunkKey`.
        """
        keys = list(keys)
        for k in keys:
            if not isinstance(k, ChunkKey):
                raise TypeError(f"lookup expects ChunkKey, got {type(k).__name__}")
        out: list[ChunkMeta | None] = [None] * len(keys)
        groups = self.router.groups(keys)
        with self._lock:
            known = [k in self._meta for k in keys]
        late: set[str] = set()  # slow shards (lookup_timeout_s + margin): misses, no direct reads
        results = self.router.call(groups, "lookup", lambda idx: (
            [str(keys[i]) for i in idx], True, False, [known[i] for i in idx]), lookup_wait_s(self.config), late)
        unanswered: list[int] = [] if groups else list(range(len(keys)))
        for name, idx in groups.items():
            res = results.get(name)
            if res is None:
                unanswered.extend([] if name in late else idx)
                continue
            for i, hit in zip(idx, res, strict=False):
                entry = None if hit is None else self._entry_for(keys[i], name, hit)
                if entry is not None:
                    self._remember(keys[i], entry)
                    out[i] = ChunkMeta(keys[i], entry.header.num_tokens, entry.positions(), entry.tier)
        if unanswered and self._shared_tiers():
            for i in unanswered:
                out[i] = self._direct_lookup(keys[i])
        hits = sum(m is not None for m in out)
        self._count("lookups", len(keys))
        self._count("hits", hits)
        self._count("misses", len(keys) - hits)
        return out

    def _entry_for(self, key: ChunkKey, shard: str, hit: tuple) -> HeaderEntry | None:
        """The entry of one shard lookup hit ``(tier, header bytes, [ref] or None)``; None
        (counted as ``read_errors``) when its header does not parse as ``key``'s."""
        tier, header_bytes, ref = hit
        with self._lock:
            old = self._meta.get(key)
        if not header_bytes and old is not None:  # we hold it: the shard sent none
            entry = old if old.shard == shard else HeaderEntry(old.header, shard, tier)
            entry.tier = tier
            return entry
        try:
            header = parse_header(header_bytes, expected_key=key)
        except FormatError as e:
            log.debug("bad header for %s from %s: %s", key, shard, e)
            self._count("read_errors")
            return None
        return HeaderEntry(header, shard, tier, ref[0] if ref else None)

    def _direct_lookup(self, key: ChunkKey) -> ChunkMeta | None:
        for tier in self._shared_tiers():
            header = read_header(tier, key)
            if header is not None:
                self._count("direct_reads")
                self._remember(key, HeaderEntry(header, "", tier.name))
                return ChunkMeta(key, header.num_tokens, tuple(header.position_list()), tier.name)
        return None

    def _remember(self, key: ChunkKey, entry: HeaderEntry) -> None:
        # A cached object stays valid: keys are content-addressed and objects first-wins,
        # so the KV under a key never changes (its encoding may: see _own_header). A chunk
        # deleted by another process may still be served from here until evicted: the same,
        # correct KV.
        with self._lock:
            self._meta[key] = entry
            self._meta.move_to_end(key)
            for old in self._meta.trim(MAX_CACHED_HEADER_BYTES):
                self._objects.pop(old, None)

    def fetch_layer(self, keys: Sequence[ChunkKey], layer_idx: int) -> Future[list[torch.Tensor | None]]:
        """Layer ``layer_idx`` of each chunk (see :class:`blend.protocols.KVSource`).

        Shapes:
            Each result is ``[2, T_i, H, D]`` (K then V) in the stored dtype on ``device``;
            None where the chunk cannot be read (never looked up and absent, shard died and
            no shared tier holds it, corrupted, ``layer_idx`` past its last layer).

        Raises:
            ValueError: negative ``layer_idx`` (immediately, not through the future).
        """
        if layer_idx < 0:
            raise ValueError(f"layer_idx={layer_idx} must be >= 0")
        keys = list(keys)
        return self._pool.submit(self._fetch, keys, layer_idx)

    def _fetch(self, keys: list[ChunkKey], layer_idx: int) -> list[torch.Tensor | None]:
        try:
            return self._fetch_unsafe(keys, layer_idx)
        except Exception as e:  # noqa: BLE001 - a future must never carry a cache fault
            log.warning("fetch_layer failed, serving misses: %r", e)
            self._count("layer_misses", len(keys))
            return [None] * len(keys)

    def fetch_layers(self, keys: Sequence[ChunkKey],
                     layer_idxs: Sequence[int]) -> list[Future[list[torch.Tensor | None]]]:
        """Every layer of ``keys``, read in order by one of the client's threads (the first
        maps the objects): :func:`blend.protocols.fetch_in_order`.

        Raises:
            ValueError: a negative layer index (at the call).
        """
        return fetch_in_order(self._pool.submit, self._fetch, keys, layer_idxs)

    def host_layers(self) -> RayHostLayers:
        """This client's layers as :class:`tiers.staging.StagedSource` reads them."""
        return RayHostLayers(self)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (see :meth:`stats`)."""
        self._count(name, n)

    def header(self, key: ChunkKey) -> ChunkHeader | None:
        """The header a lookup found for ``key`` (None: not known here)."""
        with self._lock:
            entry = self._meta.get(key)
        return None if entry is None else entry.header

    def shared_tiers(self) -> list:
        """The Redis/S3 tiers read when an owner shard is dead (may be empty)."""
        return self._shared_tiers()

    def map_for_read(self, keys: list[ChunkKey]) -> tuple[list[HeaderEntry | None], list[tuple | None]]:
        """Look up unknown keys, then map the objects of ``keys`` (one ``get_refs`` call per
        owning shard, one batched ``ray.get``): per key its entry (or None) and its mapped
        ``(array, own header)`` (or None: a miss, or only a shared tier holds it)."""
        with self._lock:
            unknown = [k for k in keys if k not in self._meta]
        if unknown:
            self.lookup(unknown)
        with self._lock:
            entries = [self._meta.get(k) for k in keys]
            arrays = [self._objects.get(k) for k in keys]
        self._request_refs(keys, entries, arrays)
        self._map_objects(keys, entries, arrays)
        return entries, arrays

    def _fetch_unsafe(self, keys: list[ChunkKey], layer_idx: int) -> list[torch.Tensor | None]:
        # one deadline for the whole read (issue 20): past it, direct reads from the shared tiers
        # (one io_timeout_s each, serial) are not started; those keys are misses (``timeouts``)
        deadline = time.monotonic() + self._fetch_timeout_s()
        entries, arrays = self.map_for_read(keys)
        # slice, check and copy each layer; shared tiers for the rest
        out: list[torch.Tensor | None] = []
        for k, e, a in zip(keys, entries, arrays, strict=True):
            t = None
            if e is not None and layer_idx < e.header.num_layers:
                if a is not None:
                    t = self._slice(k, a[1], a[0], layer_idx)
                elif self._shared_tiers():
                    if time.monotonic() < deadline:
                        t = self._direct_layer(k, e.header, layer_idx)
                    else:
                        self._count("timeouts")
            self._count("layer_reads" if t is not None else "layer_misses")
            out.append(t)
        return out

    def _request_refs(self, keys: list[ChunkKey], entries: list[HeaderEntry | None],
                      arrays: list[tuple | None]) -> None:
        """Set ``entries[i].ref`` for shard-held chunks not mapped and without a ref yet: one
        ``get_refs`` call per shard, in parallel (a shard that fails leaves them unset)."""
        need = [i for i, (e, a) in enumerate(zip(entries, arrays, strict=True))
                if e is not None and a is None and e.ref is None and e.shard]
        if not need:
            return
        groups: dict[str, list[int]] = {}
        for i in need:
            groups.setdefault(entries[i].shard, []).append(i)
        results = self.router.call(groups, "get_refs",
                                   lambda idx: ([str(keys[i]) for i in idx], self.timeout_s))
        for name, idx in groups.items():
            for i, got in zip(idx, results.get(name) or [None] * len(idx), strict=False):
                if got is not None:
                    entries[i].ref = got[0]

    def _map_objects(self, keys: list[ChunkKey], entries: list[HeaderEntry | None],
                     arrays: list[tuple | None]) -> None:
        """``ray.get`` the objects of entries with a ref (zero-copy on the same node) into
        ``arrays[i]`` and the mapped LRU, then evict it down to ``max_mapped_bytes``.

        Entries are shared with the pool's other fetches: each ref is read once here and
        cleared only if no other thread replaced it meanwhile (the array holds the object, or
        it is lost: refs are not kept)."""
        import ray

        fetch, refs = [], []
        for i, (e, a) in enumerate(zip(entries, arrays, strict=True)):
            ref = e.ref if e is not None and a is None else None
            if ref is not None:
                fetch.append(i)
                refs.append(ref)
        if not fetch:
            return
        deadline = time.monotonic() + self.timeout_s  # the batch and the one-by-one retry share it
        try:  # one batched get (0.3 ms per ref saved under load, measured in the bench)
            got = ray.get(refs, timeout=self.timeout_s)
        except Exception:  # noqa: BLE001 - find which one failed, one by one
            got = []
            for i, ref in zip(fetch, refs, strict=True):
                try:  # timeout 0 past the deadline: an object already local is still taken
                    got.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
                except Exception as e:  # noqa: BLE001 - owner died / object lost / slow
                    log.debug("object of %s unavailable: %r", keys[i], e)
                    self._count("shard_errors")
                    got.append(None)
        for j, (i, ref, arr) in enumerate(zip(fetch, refs, got, strict=True)):
            with self._lock:
                if entries[i].ref is ref:
                    entries[i].ref = None
            got[j] = None if arr is None else self._own_header(keys[i], entries[i].header, arr)
        with self._lock:
            for i, m in zip(fetch, got, strict=True):
                if m is not None:
                    arrays[i] = m
                    self._objects[keys[i]] = m
            mapped = sum(a.nbytes for a, _ in self._objects.values())
            while mapped > self.max_mapped_bytes and self._objects:
                mapped -= self._objects.popitem(last=False)[1][0].nbytes

    def _own_header(self, key: ChunkKey, looked_up: ChunkHeader,
                    arr: np.ndarray) -> tuple[np.ndarray, ChunkHeader] | None:
        """``(arr, its own header)`` (:func:`cluster.cache.headers.own_header`), or None
        (counted) when it is not the chunk the lookup described."""
        try:
            return arr, own_header(key, looked_up, arr)
        except FormatError as err:
            log.debug("object of %s rejected: %s", key, err)
            self._count("read_errors")
            return None

    def _slice(self, key: ChunkKey, header: ChunkHeader, arr: np.ndarray, layer_idx: int):
        try:  # a shard's host memory: every layer checked as it entered (as staging copies it)
            return object_layer(header, layer_idx, arr, checked=True).to(self.device)
        except (FormatError, ValueError) as err:
            log.debug("layer %d of %s rejected: %s", layer_idx, key, err)
            self._count("read_errors")
            return None

    def _direct_layer(self, key: ChunkKey, header: ChunkHeader, layer_idx: int):
        """One layer from the first shared tier with a valid copy (the stack checks it), or None."""
        if not self._shared_tiers():
            return None
        raw = bytearray(header.layer_nbytes)  # raw layer bytes: the same in any encoding
        h = self._shared_stack.read_layers(key, [layer_idx], [raw])
        if h is None:
            return None
        self._count("direct_reads")
        return layer_tensor(raw, h.layer_shape, h.dtype).to(self.device)

    # -- KVSink ----------------------------------------------------------------------------------
    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> None:
        """Store ``kv`` ``[L, 2, T, H, D]`` under ``key`` (asynchronous, idempotent).

        ``kv`` is encoded (copied) before returning, so the caller may reuse its buffer.
        A chunk this client already knows to be stored, or is still putting, is skipped.
        Never raises for cache faults (a dead owner drops the put and counts ``put_errors``).

        Raises:
            TypeError: ``key`` is not a :class:`ChunkKey`.
            ValueError: ``kv`` not 5-D with axis 1 of size 2, or an unsupported dtype.
        """
        if not isinstance(key, ChunkKey):
            raise TypeError(f"put expects a ChunkKey, got {type(key).__name__}")
        if not self._stored_or_sending(key):
            self._writer.send(key, encode_kv(key, kv, positions, compress=False))

    def put_object(self, key: ChunkKey, obj) -> None:
        """:meth:`put` of a chunk object already encoded (the agent forwards what vLLM's
        process encoded: it is not decoded and encoded again); the owner shard validates it."""
        if not self._stored_or_sending(key):
            self._writer.send(key, obj)

    def _stored_or_sending(self, key: ChunkKey) -> bool:
        # known stored, or a put of it still in flight (a threaded shard may run two puts
        # of one key in either order: deduplicating here makes this client's first win)
        with self._lock:
            known = key in self._meta
        return known or self._writer.in_flight(key)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait up to ``timeout_s`` for pending puts and the shards' writes to lower tiers
        (:meth:`cluster.cache.puts.ShardWriter.flush` says exactly when it returns False)."""
        return self._writer.flush(timeout_s)

    # -- administration --------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is stored on its shard (False when the shard does not answer)."""
        keys = list(keys)
        groups = self.router.groups(keys)
        results = self.router.call(groups, "contains", lambda idx: ([str(keys[i]) for i in idx],))
        out = [False] * len(keys)
        for name, idx in groups.items():
            for i, c in zip(idx, results.get(name) or [], strict=False):
                out[i] = bool(c)
        return out

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Delete keys from their shards (and shared tiers); how many existed (where answered)."""
        keys = list(keys)
        with self._lock:
            for k in keys:
                self._meta.pop(k, None)
                self._objects.pop(k, None)
        groups = self.router.groups(keys)
        results = self.router.call(groups, "delete", lambda idx: ([str(keys[i]) for i in idx],))
        return int(sum(results.values()))

    def clear(self, namespace: str | None = None, stale: bool = False) -> int:
        """Delete every cached chunk (of ``namespace`` when given; ``stale``: only objects of
        another chunk format version) on every shard; returns the number deleted (shards that
        do not answer are skipped)."""
        with self._lock:
            self._meta.clear()
            self._objects.clear()
        return int(sum(self.router.call_all("clear", namespace, stale).values()))

    def shard_stats(self) -> dict[str, dict]:
        """``{shard name: CacheShard.stats()}`` of every shard that answers within
        ``call_timeout_s`` (see :meth:`cluster.cache.shard.CacheShard.stats`)."""
        return self.router.call_all("stats")

    def stats(self) -> dict:
        """This client's counters and the shards' statistics, as one JSON-able dict.

        Returns:
            ``{'client': {name: count}, 'shards': {shard name: CacheShard.stats()}}``.
            ``client`` holds cumulative event counts since this client was constructed
            (:data:`COUNTERS`: keys looked up / hit / missed, layers read / missed, puts sent
            / failed, shard errors and timeouts, reads served by a shared tier directly,
            corrupted objects, keys whose owner moved); ``shards`` is :meth:`shard_stats`.
        """
        with self._lock:
            client = dict(self.counters)
        return {"client": client, "shards": self.shard_stats()}

    def close(self) -> None:
        """Stop the client's fetch threads, cancelling queued fetches (pending puts keep
        running on the shards); ``fetch_layer`` must not be called afterwards."""
        self._pool.shutdown(wait=False, cancel_futures=True)
