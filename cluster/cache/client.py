"""``CacheClient``: the one cache client — blend's KV source and sink over a chain of transports.

What is read and checked once lives here, whatever the medium: the header cache (each header
parsed once per key), the held-object LRU (whole chunk objects between requests), the header
check of every object a transport hands over and the layer decode, the read deadline, the
counters, the put bound (the chunk object encoded once, here) and direct reads from the shared
Redis/S3 tiers. What differs by medium sits behind :class:`~cluster.cache.ops.Transport`
(:mod:`cluster.cache.ops` declares each op once)::

    lookup(keys)          transport.lookup -> per hit its header bytes (none when this client
                          holds them), parsed here; keys whose owner failed: the shared tiers
    fetch_layers(keys,..) map_for_read once per request (objects it does not hold:
                          transport.objects), then each layer a slice and one copy
                          (:mod:`cluster.cache.layer_reads`)
    put(key, kv)          encode_kv once -> transport.put, at most MAX_PENDING_PUTS /
                          MAX_PENDING_PUT_BYTES unsettled (more: the newest is dropped, counted)
    contains, delete, flush, clear, stats   the transport's, as typed answers

The chain: each call goes to the first transport that is ``up`` (the connector's default: the
cache agent, then the machine-local cache while it is down; :func:`cluster.cache.factory.make_client`).
Over a transport that is not ``threaded`` (``local``) reads run in the caller's thread, over the
others on 4 threads of the client.

Failure behaviour: every wait is bounded (lookups by the lookup deadline, object reads by
``max(call_timeout_s, load_timeout_s)``: past it no direct read is started); a fault — no or a
malformed answer, a dead shard, agent or tier, a lost, corrupted, truncated or foreign object,
a full arena — is a miss (``None``) and a counter, never an exception. Only caller mistakes
raise (:class:`cluster.cache.protocol.CacheClientProtocol`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from blend.protocols import ChunkMeta
from cluster.cache.headers import (
    HeaderCache,
    HeaderEntry,
    HeldObjects,
)
from cluster.cache.layer_reads import LayerReads
from cluster.cache.ops import (
    ClearRequest,
    FlushRequest,
    KeysRequest,
    LookupRequest,
    PutRequest,
    StatsRequest,
    Transport,
)
from cluster.cache.puts import PutBound
from tiers.codec import check_kv, encode_kv
from tiers.format import FormatError, parse_header
from tiers.keys import ChunkKey

log = logging.getLogger("kvblend.client")

#: bytes of chunk headers remembered after lookups (LRU by :func:`cluster.cache.headers.entry_nbytes`,
#: ~20 KB for 32 layers of 256 tokens; 65536 headers were ~1.2 GiB); a forgotten one costs a parse.
MAX_CACHED_HEADER_BYTES = 64 << 20
#: default bytes of objects held between requests (an arena holds its size). Clients share a
#: node's object store (2 GiB by default): at 1 GiB each, two vLLM workers' clients filled it
#: and promotions failed (the demo, 2026-11-29: 3 of 16 requests fell back). A request maps ~140 MB.
DEFAULT_MAX_MAPPED_BYTES = 256 << 20
#: the client's own counters (each transport adds its own: :attr:`Transport.counters`)
COUNTERS = ("lookups", "hits", "misses", "read_errors", "direct_reads", "timeouts", "puts", "puts_dropped",
            "layer_reads", "layer_misses")


class CacheClient(LayerReads):
    """The cache client (a :class:`~cluster.cache.protocol.CacheClientProtocol`; see the
    module docstring; its layer reads: :class:`~cluster.cache.layer_reads.LayerReads`).

    Args:
        config: a :class:`cluster.config.KVBlendConfig` (deadlines, the shared Redis/S3 tiers);
            None for a client over local transports only.
        namespace: chunk namespace digest this client works in (default for ``clear``).
        device: device of the tensors ``fetch_layer`` returns.
        max_mapped_bytes: bytes of objects held between requests over the Ray transport
            (the objects of one read are always held while it runs).
        thread_initializer: run first in each of the client's 4 fetch threads (the vLLM wing
            passes one that widens a CPU worker's one-core affinity); None runs nothing.
        transports: the chain (default: one :class:`~cluster.cache.ray_transport.RayTransport`
            over ``config``).
        borrowed: transports of the chain this client does not close (shared with others).

    Raises:
        ConnectionError: the default Ray transport finds Ray unreachable.
    """

    def __init__(self, config=None, namespace: str | None = None, device: str | torch.device = "cpu",
                 max_mapped_bytes: int = DEFAULT_MAX_MAPPED_BYTES,
                 thread_initializer: Callable[[], None] | None = None, *,
                 transports: Sequence[Transport] | None = None, borrowed: Sequence[Transport] = ()) -> None:
        if transports is None:
            from cluster.cache.ray_transport import RayTransport

            transports = [RayTransport(config, max_mapped_bytes)]
        self.config, self.namespace = config, namespace
        self.device = torch.device(device)
        self.transports: tuple[Transport, ...] = tuple(transports)
        self._borrowed = tuple(borrowed)
        self._lock = threading.Lock()
        self._meta = HeaderCache()          # ChunkKey -> HeaderEntry, oldest first
        self.objects = HeldObjects()        # ChunkKey -> (object, own header, checked, progress)
        #: cumulative event counts since construction (see :meth:`stats`)
        self.counters = dict.fromkeys(COUNTERS + tuple(c for t in self.transports for c in t.counters), 0)
        self._bound = PutBound(self.count)
        self.timeout_s = getattr(getattr(config, "cluster", None), "call_timeout_s", 2.0)
        #: one read's deadline: the longer of load_timeout_s (the engine waits no longer) and call_timeout_s
        self.fetch_timeout_s = max(self.timeout_s, getattr(getattr(config, "blend", None), "load_timeout_s", 0.0))
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvblend-client", initializer=thread_initializer)
        self._shared: list | None = None if config is not None and any(t.remote for t in self.transports) else []
        for t in self.transports:
            t.bind(self)

    # -- the chain and the hooks transports call -------------------------------------------------
    @property
    def transport(self) -> Transport:
        """The transport serving now: the first of the chain that is up (else the last)."""
        for t in self.transports[:-1]:
            if t.up:
                return t
        return self.transports[-1]

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (see :meth:`stats`)."""
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def evict_oldest(self, keep) -> bool:
        """Drop the oldest held object not of ``keep`` (an arena needs room); False: none left."""
        with self._lock:
            victim = next((k for k in self.objects if k not in keep), None)
            dropped = None if victim is None else self.objects.pop(victim, None)
        del dropped  # the last reference: its memory is free unless a reader holds a view
        return victim is not None

    def placement_changed(self, owner: Callable[[str], str]) -> None:
        """Forget what this client knows of keys whose owner changed (they become misses)."""
        with self._lock:
            moved = [k for k, e in self._meta.items() if e.shard and owner(str(k)) != e.shard]
        self.forget(moved)
        self.count("placement_moves", len(moved))

    def shared_tiers(self) -> list:
        """The Redis/S3 tiers read directly when a remote transport cannot serve a key (or none)."""
        if self._shared is None:
            from tiers.lower import shared_tiers
            from tiers.stack import TierStack

            tiers = shared_tiers(self.config.tiers)
            # direct layer reads go through them as a stack: no promotion or writes between the
            # shared tiers (a reader's copy of an S3 hit into Redis is its owner's job)
            self._shared_stack = TierStack(tiers, write_down=(), promote=False, on_event=self._shared_event) if tiers else None
            self._shared = tiers
        return self._shared

    def _shared_event(self, kind: str, tier: str, nbytes: int) -> None:
        if kind == "corrupt":  # a shared copy failed its checks (tag, XXH3) and was deleted
            self.count("read_errors")

    # -- KVSource ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> list[ChunkMeta | None]:
        """Which keys are cached, in one round trip of the serving transport (see
        :meth:`cluster.cache.protocol.CacheClientProtocol.lookup`).

        Raises:
            TypeError: a key that is not a :class:`ChunkKey`.
        """
        keys = tuple(keys)
        for k in keys:
            _check_key("lookup", k)
        t = self.transport
        with self._lock:
            known = tuple(k in self._meta for k in keys) if t.remote else ()
        answer = t.lookup(LookupRequest(keys, known))
        out: list[ChunkMeta | None] = [None] * len(keys)
        if answer is not None:
            missed = []
            for i, hit in enumerate(answer.hits):
                entry = None if hit is None else self._entry_for(keys[i], hit)
                if entry is not None:
                    out[i] = ChunkMeta(keys[i], entry.header.num_tokens, entry.positions(), entry.tier)
                elif hit is None and i not in answer.unanswered:
                    missed.append(keys[i])
            self.forget(missed)  # not there any more (deleted, moved): nothing held for it is read
            if answer.unanswered and t.remote and self.shared_tiers():
                for i in answer.unanswered:
                    out[i] = self._direct_lookup(keys[i])
        hits = sum(m is not None for m in out)
        with self._lock:
            self.counters["lookups"] += len(keys)
            self.counters["hits"] += hits
            self.counters["misses"] += len(keys) - hits
        return out

    def _entry_for(self, key: ChunkKey, hit) -> HeaderEntry | None:
        """The remembered entry of one lookup hit: its header bytes parsed and checked as
        ``key``'s once (a hit without them reuses the header held); None (``read_errors``)
        when they do not parse."""
        with self._lock:
            old = self._meta.get(key)
        if not hit.header and old is not None:
            entry = old if (old.shard, old.tier) == (hit.source, hit.tier) else HeaderEntry(old.header, hit.source, hit.tier)
        else:
            try:
                entry = HeaderEntry(parse_header(hit.header, expected_key=key), hit.source, hit.tier)
            except FormatError as e:
                log.debug("bad header for %s from %s: %s", key, hit.source, e)
                self.count("read_errors")
                return None
        self._remember(key, entry)
        return entry

    def _direct_lookup(self, key: ChunkKey) -> ChunkMeta | None:
        from tiers.reader import read_header

        for tier in self.shared_tiers():
            header = read_header(tier, key)
            if header is not None:
                self.count("direct_reads")
                entry = HeaderEntry(header, "", tier.name)
                self._remember(key, entry)
                return ChunkMeta(key, header.num_tokens, entry.positions(), tier.name)
        return None

    def _remember(self, key: ChunkKey, entry: HeaderEntry) -> None:
        # keys are content-addressed and objects first-wins: the KV under a key never changes
        # (its encoding may: objects are sliced with their own header)
        with self._lock:
            self._meta[key] = entry
            self._meta.move_to_end(key)
            for old in self._meta.trim(MAX_CACHED_HEADER_BYTES):
                self.objects.pop(old, None)

    def forget(self, keys=None) -> None:
        """Drop the headers and objects held for ``keys`` (all when None)."""
        with self._lock:
            if keys is None:
                self._meta.clear()
                self.objects.clear()
            for k in keys or ():
                self._meta.pop(k, None)
                self.objects.pop(k, None)

    def drop_objects(self) -> None:
        """Drop every held object, keep the headers (a lost agent's arena, a cold benchmark read)."""
        with self._lock:
            dropped, self.objects = self.objects, HeldObjects()
        del dropped

    def arena_stats(self) -> dict[str, int] | None:
        """The agent's arena: ``arena_bytes``, ``arena_used_bytes``, ``arena_peak_bytes`` (or None)."""
        return next((t.arenas.stats() for t in self.transports if hasattr(t, "arenas")), None)

    # -- KVSink ----------------------------------------------------------------------------------
    def put(self, key: ChunkKey, kv: torch.Tensor, positions: Sequence[int] | None = None) -> None:
        """Encode ``kv`` ``[L, 2, T, H, D]`` once and hand it to the serving transport
        (asynchronous, idempotent); ``kv`` is copied before returning. A chunk this client
        knows to be stored, or is still putting, is skipped; past the bound (module docstring)
        the put is dropped before it is encoded (``puts_dropped``, one warning). Never raises
        for cache faults.

        Raises:
            TypeError: ``key`` is not a :class:`ChunkKey`.
            ValueError: ``kv`` not 5-D with axis 1 of size 2, or an unsupported dtype.
        """
        _check_key("put", key)
        check_kv(kv)
        t = self.transport
        with self._lock:
            known = key in self._meta
        if known or getattr(t, "in_flight", lambda k: False)(key):
            return
        estimate = kv.numel() * kv.element_size()
        if not self._bound.admit(estimate):
            return
        try:
            obj = encode_kv(key, kv, positions, compress=t.compress)  # the only encoding before the shard
        except BaseException:
            self._bound.release(estimate)
            raise
        nbytes = len(obj)
        self._bound.resize(estimate, nbytes)
        released = threading.Event()

        def done(_stored: bool = False) -> None:
            if not released.is_set():
                released.set()
                self._bound.release(nbytes)

        try:
            sent = t.put(PutRequest(key, obj), done)
        except Exception as e:  # noqa: BLE001 - a put that cannot be sent is dropped
            log.debug("put of %s not sent: %r", key, e)
            sent = False
        if sent:
            self.count("puts")
        else:
            done()

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait up to ``timeout_s`` for pending puts and write-downs (:meth:`~cluster.cache.puts.ShardWriter.flush`)."""
        return bool(self.transport.flush(FlushRequest(float(timeout_s))))

    # -- administration --------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is stored (False where its store does not answer); promotes nothing."""
        keys = tuple(keys)
        got = self.transport.contains(KeysRequest(keys))
        return list(got) if got is not None else [False] * len(keys)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Delete keys from every tier holding them; how many existed (where answered)."""
        keys = tuple(keys)
        self.forget(keys)
        return self.transport.delete(KeysRequest(keys)) or 0

    def clear(self, namespace: str | None = None, stale: bool = False) -> int:
        """Delete every cached chunk (of ``namespace`` when given; ``stale``: only objects of
        another chunk format version) where the serving transport keeps them (every shard), and
        from the machine-local tiers of the chain; returns the serving transport's count."""
        self.forget()
        serving, request = self.transport, ClearRequest(namespace, stale)
        for t in self.transports:
            if t is not serving and t.name == "local":
                t.clear(request)
        return serving.clear(request) or 0

    def stats(self) -> dict:
        """``{'client': cumulative counts of :data:`COUNTERS` and each transport's, ...}`` and
        what each transport says of its store (``'shards'``, ``'tiers'``, ``'arena'``,
        ``'agent'``: :meth:`cluster.cache.protocol.CacheClientProtocol.stats`). JSON-able."""
        out: dict = {}
        for t in reversed(self.transports):  # the first transport's entries win
            out.update(t.stats(StatsRequest()))
        with self._lock:
            out["client"] = dict(self.counters)
        return out

    def close(self) -> None:
        """Stop the fetch threads (queued fetches cancelled) and close the transports it owns."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.transports:
            if t not in self._borrowed:
                t.close()


def _check_key(call: str, key: object) -> None:
    if not isinstance(key, ChunkKey):
        raise TypeError(f"{call} expects a ChunkKey, got {type(key).__name__}")

