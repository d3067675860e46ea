"""The cache shard: a Ray actor owning one node's host and disk tiers, above shared Redis/S3.

This module is the actor's state and methods (:class:`CacheShard`). Starting, finding and
stopping the actors is :mod:`cluster.cache.lifecycle`: one shard per cache node (a node
advertising ``shard_resource``; ``shards_per_node`` for more), named
``kvblend-shard-<node name>@<node_id[:8]>-<i>``, detached, in namespace ``ray_namespace``, created
idempotently and restarted by Ray. Its disk directory is ``<disk_root>/<node name>-<i>``
(``disk_path``, else ``<cache_dir>/disk``; :mod:`cluster.cache.identity`: ``$KVBLEND_NODE_NAME``
or the host name, locked while in use), so a shard restarted on the same machine finds its
disk chunks again, also under a new Ray node id (:class:`tiers.disk.DiskTier` rebuilds its
index from the files; each object is validated when read, a bad one is a miss).

Tiers, top to bottom: ``host`` (a :class:`tiers.host.HostTier` of Ray ``ObjectRef``\\ s) →
``disk`` → ``redis`` → ``s3`` (the last two shared by all shards, opened by
:func:`tiers.lower.shared_tiers`). The tiers below host memory are one
:class:`tiers.stack.TierStack` (``lower_stack``): it encodes what goes below memory (lz4 per
layer when ``compression='lz4'``), writes down only to tiers lacking a chunk, validates
what it reads, deletes a corrupt copy and falls through to the next tier, and copies a
Redis/S3 hit into the tiers above it (disk; Redis for an S3 hit). The disk keeps lz4 objects
like Redis/S3 (``raw_top=False``): the disk is not memory, lz4 saves its space and the
bytes a promotion reads, a Redis/S3 hit is copied into it unchanged, and a restarted shard
finds the encoding it always wrote (readers slice each object with its own header, so
encodings may differ between tiers). ``put`` writes the host tier at once and the lower tiers
in the background (write-through: the disk so a restart loses nothing, Redis/S3 so other
shards and clients with a dead owner still find it); ``drain`` waits for those writes. The
background writes are :mod:`tiers.write_behind`'s: bounded (past the bound a put's
write-down is dropped, counted ``writes_dropped``, metric ``kvblend_writes_dropped``, one
warning per shard, and the chunk stays in host memory only, so a slow or stuck tier never
makes ``put``, or the actor's callers, wait), and readable while pending (a chunk evicted
from host memory before its write landed is put back from it, ``write_behind_hits``). A
lookup that finds a chunk below host memory starts its promotion (prefetch) into host memory
in the background. The stack's writes and corrupt copies feed
the shard's counters and metrics (``on_event``).

Bulk bytes never travel through actor method returns. Each host-resident chunk object is
one numpy ``uint8`` array ``ray.put`` by the shard (so the shard owns it and our eviction,
not the caller, decides its lifetime); ``get_refs`` returns its ``ObjectRef`` wrapped in a
list (Ray then passes the ref, not the value) and the client ``ray.get``\\ s it: zero-copy
from the node's shared-memory object store on the same node, one transfer per chunk
otherwise. Why (2-core dev box, 2026-11-29): returning 32 MiB from a method took 18 ms, a
``ray.get`` of its ref 0.1 ms. With this design ``kvblend bench cluster`` (8 MiB chunks of 32 layers,
16 chunks read layer by layer) measured client vs a direct in-process host-tier read of the
same objects, over three runs: 0.74-0.98 of the direct GB/s (3-5 GB/s) same-node and
0.80-0.97 cross-node once a process has mapped the chunks (``client_warm_ratio``); 0.6-0.77
when each pass first fetches the 16 refs (``client_ratio``; each ``ObjectRef`` returned by a
call costs Ray ~0.3 ms of borrower bookkeeping, which is also why ``lookup`` returns no
refs), lower with 2 MiB chunks (``--quick``: 0.35-0.87), on a shared machine (load 7-12).

Memory budget: the object store holds ``host_size_gib`` plus in-flight puts; ``kvblend server``
sets ``object_store_gib`` (default: the node's host tiers plus headroom; Ray's is 30% of RAM).

Failure behaviour: methods never raise for cache faults; a tier error is a miss counted in
stats and metrics; ``lookup`` answers within ``lookup_timeout_s`` whatever the tiers below
host memory do (:mod:`cluster.cache.deadline`: late keys are misses, a breaker per tier; its
counters are also the metrics ``kvblend_lookup_timeouts``, ``kvblend_breaker_transitions`` and
``kvblend_breaker_open``); a corrupted or foreign object (checked by :mod:`tiers.format` /
:mod:`tiers.reader`; with an object key, :mod:`tiers.auth`: an object without a valid MAC)
is a miss plus ``read_errors``. Malformed key strings raise ``ValueError`` through Ray.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from cluster.cache.deadline import LowerLookup
from cluster.cache.identity import claim_disk_dir, node_name
from cluster.cache.metrics import ShardMetrics
from cluster.cache.node_drain import drain_to_shared
from cluster.env import configure_object_auth
from tiers import write_behind
from tiers.config import TiersConfig
from tiers.format import FormatError
from tiers.keys import ChunkKey
from tiers.lower import shared_tiers
from tiers.reader import validate_object
from tiers.stack import TierStack
from tiers.write_behind import WriteBehind

log = logging.getLogger("kvblend.shard")

#: prefetched chunks remembered until served (only to count ``prefetch_hits``); beyond it the
#: oldest is forgotten (a later read of it is then not counted as a prefetch hit)
MAX_PREFETCHED = 65536


class CacheShard:
    """The shard's state and methods; wrapped as a Ray actor by
    :func:`cluster.cache.lifecycle.start_shards`.

    Args:
        name: the actor name.
        tiers_config: sizes, eviction policy, disk path, Redis/S3 URLs.
        disk_root: parent of the per-shard disk directories.
        metrics: export ``kvblend_*`` metrics through ``ray.util.metrics``.
        env: variables set in this actor's process before its tiers open (e.g. S3 credentials):
            constructor arguments, unlike a Ray ``runtime_env``, are not shown by ``ray list actors``.
        index: this shard's number on its node; with the node name it names the disk directory.

    All key arguments are ``str(ChunkKey)``; malformed ones raise ``ValueError``.
    """

    def __init__(self, name: str, tiers_config: TiersConfig, disk_root: str,
                 metrics: bool = True, env: dict[str, str] | None = None, index: int = 0) -> None:
        import ray

        os.environ.update(env or {})  # this actor's own process (issue 19: no runtime_env secrets)
        configure_object_auth(dict(os.environ))  # a bad object key fails the actor's start

        from tiers.disk import DiskTier
        from tiers.host import HostTier

        self.name = name
        self.cfg = tiers_config
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_name = node_name()  # stable across Ray node ids (issue #18 item 4)
        self.started_at = time.time()
        self.host = HostTier(int(tiers_config.host_size_gib * 2**30), tiers_config.eviction_policy,
                             name="host")
        self.disk, self._disk_lock = None, None  # the lock fd lives as long as this shard
        if tiers_config.disk_size_gib > 0:
            path, self._disk_lock = claim_disk_dir(disk_root, self.node_name, index)
            self.disk = DiskTier(path, int(tiers_config.disk_size_gib * 2**30),
                                 tiers_config.eviction_policy, name="disk", io_timeout_s=tiers_config.io_timeout_s)
        self.shared = shared_tiers(tiers_config)
        self.lower = ([self.disk] if self.disk is not None else []) + self.shared
        # lz4 on disk too (raw_top=False): see the module docstring
        self.lower_stack = TierStack(
            self.lower, compression=tiers_config.compression, raw_top=False,
            on_event=self._on_tier_event) if self.lower else None
        self.metrics = ShardMetrics(name, metrics)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvblend-shard")
        self._lock = threading.Lock()
        self._promoting: dict[ChunkKey, Future] = {}
        self._prefetched: OrderedDict[ChunkKey, None] = OrderedDict()  # oldest first
        self.writes = WriteBehind(self._write_down, self._writes_dropped, self._undo_write,
                                  name="kvblend-shard-write")
        # lower-tier header reads of lookups: parallel, by lookup_timeout_s, breaker per tier
        self._lower_lookup = LowerLookup(tiers_config.lookup_timeout_s, self._count, name,
                                         metrics=self.metrics)
        self.counters = dict.fromkeys(
            ("lookups", "misses", "read_errors", "puts", "put_rejected", "prefetch_started",
             "prefetch_hits", "promotions", "write_errors", "writes_dropped", "lookup_timeouts",
             "breaker_open", "breaker_half_open", "breaker_closed", "write_behind_hits"), 0)
        self.counters.update({f"hits_{t.name}": 0 for t in [self.host, *self.lower]})
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True)
        self._publisher.start()

    # -- helpers ---------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def _host_entry(self, key: ChunkKey):
        """(ref, header bytes, object bytes) of a host-resident chunk, or None. A chunk evicted
        from host memory before its write-down landed is put back from the pending write
        (``write_behind_hits``): it is in no tier for that window (:mod:`tiers.write_behind`)."""
        entry = self.host.get_object(key)
        if entry is None and self.writes.held(key) is not None and self.writes.restore(
                key, lambda obj, header: self._store_host(key, obj, header.header_end) is not None):
            self._count("write_behind_hits")
            entry = self.host.get_object(key)
        return entry

    def _store_host(self, key: ChunkKey, obj, header_end: int) -> object | None:
        """``ray.put`` the object once and keep its ref in the host tier; returns the ref."""
        import ray

        arr = np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj
        ref = ray.put(arr)
        header = bytes(memoryview(arr)[:header_end])
        if not self.host.put_object(key, (ref, header, arr.nbytes), arr.nbytes):
            return None
        self.metrics.inc("kvblend_bytes_in", arr.nbytes, "host")
        return ref

    def _on_tier_event(self, kind: str, tier: str, nbytes: int) -> None:
        """The lower stack's writes and corrupt copies, as counters and metrics."""
        if kind == "write":
            self.metrics.inc("kvblend_bytes_in", nbytes, tier)
        elif kind == "write_failed":
            self._count("write_errors")
        elif kind == "corrupt":  # deleted there; the read fell through (a miss if nowhere)
            log.debug("%s: %s held a corrupt object", self.name, tier)
            self._count("read_errors")
            self.metrics.inc("kvblend_read_errors", 1, tier)

    def _promote(self, key: ChunkKey, prefetch: bool) -> object | None:
        """Read the whole object from the first lower tier holding a valid one into host
        memory (the stack copies a Redis/S3 hit into the tiers above it in background)."""
        entry = self._host_entry(key)
        if entry is not None:
            return entry[0]
        found = self.lower_stack.find(key) if self.lower_stack is not None else None
        if found is None:
            return None
        tier, obj, header = found
        self.metrics.inc("kvblend_bytes_out", len(obj), tier)
        ref = self._store_host(key, obj, header.header_end)
        self._count("promotions")
        if prefetch:
            with self._lock:
                self._prefetched[key] = None
                self._prefetched.move_to_end(key)
                while len(self._prefetched) > MAX_PREFETCHED:
                    self._prefetched.popitem(last=False)
        return ref

    def _promote_async(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._promoting:
                return
            fut = self._pool.submit(self._promote, key, True)
            self._promoting[key] = fut
        self._count("prefetch_started")
        self.metrics.inc("kvblend_prefetch_started")
        fut.add_done_callback(lambda _f, k=key: self._promoting.pop(k, None))

    def _write_down(self, key: ChunkKey, arr: np.ndarray, header) -> None:
        """Into every lower tier lacking ``key`` (first wins), lz4-encoded once, on this
        thread (so the bound covers Redis/S3 too); failures count ``write_errors``."""
        try:
            self.lower_stack.store(key, arr, [t.name for t in self.lower], header=header)
        except (FormatError, ValueError) as e:
            log.debug("%s: write-down of %s failed: %s", self.name, key, e)
            self._count("write_errors")

    def _undo_write(self, key: ChunkKey) -> None:
        """A write-down that landed after its chunk was deleted: delete it below host memory too."""
        self.lower_stack.delete([key])  # a failing tier is logged, never raised

    def _writes_dropped(self, pending: int, pending_bytes: int, first: bool) -> None:
        """:class:`WriteBehind`'s bound dropped a put's write-down: count it, warn once."""
        self._count("writes_dropped")
        self.metrics.inc("kvblend_writes_dropped")
        if first:
            log.warning("%s: %d write-downs (%d bytes) pending, the bound (MAX_PENDING_WRITES"
                        "=%d, MAX_PENDING_WRITE_BYTES=%d): dropping new ones (host memory "
                        "only; counted writes_dropped; warned once)", self.name, pending,
                        pending_bytes, write_behind.MAX_PENDING_WRITES,
                        write_behind.MAX_PENDING_WRITE_BYTES)

    # -- actor methods -----------------------------------------------------------------------
    def ready(self) -> dict:
        """Identity: name, Ray node id, node name (stable), pid, disk path, tiers top down."""
        return {"name": self.name, "node_id": self.node_id, "node_name": self.node_name,
                "pid": os.getpid(), "disk_path": self.disk.path if self.disk is not None else "",
                "tiers": [t.name for t in [self.host, *self.lower]]}

    def lookup(self, keys: Sequence[str], prefetch: bool = True, with_refs: bool = False,
               known: Sequence[bool] | None = None) -> list[tuple | None]:
        """Which of ``keys`` this shard can serve, with each hit's header bytes.

        Returns:
            Per key ``(tier name, prefix+header bytes, [ObjectRef] or None)`` or None. The
            header is a few KB (the client parses it with :func:`tiers.format.parse_header`).
            With ``with_refs`` host-memory hits carry their ref; off by default because each
            returned ref costs Ray a borrower registration (16 refs added ~5 ms to a 1 ms
            call here) and the scheduler-side lookups never read layers. Where ``known[i]``
            the caller already holds that key's header (objects never change under a key)
            and the header slot is ``b""``: parsing 16 headers cost the client ~1 ms.
            Hits below host memory start a background promotion when ``prefetch``. Keys
            not in host memory are looked up in the lower tiers in parallel, one header
            read per hit, within ``lookup_timeout_s`` of the call's start whatever the tiers
            do (:class:`cluster.cache.deadline.LowerLookup`: late keys are misses, counted
            ``lookup_timeouts``; a per-tier breaker skips a tier that keeps timing out).
        """
        t0 = time.perf_counter()
        started = time.monotonic()  # the lookup_timeout_s deadline counts from here
        parsed = [ChunkKey.parse(text) for text in keys]
        self._count("lookups", len(parsed))
        out: list[tuple | None] = [None] * len(parsed)
        rest: list[int] = []  # not in host memory
        for i, key in enumerate(parsed):
            entry = self._host_entry(key)
            if entry is None:
                rest.append(i)
                continue
            header = b"" if known is not None and known[i] else entry[1]
            out[i] = ("host", header, [entry[0]] if with_refs else None)
            self._count("hits_host")
            self.metrics.inc("kvblend_hits", 1, "host")
        found = self._lower_lookup.find(self.lower, [parsed[i] for i in rest], started) \
            if rest and self.lower else [None] * len(rest)
        for i, hit in zip(rest, found, strict=True):
            if hit is None:
                self._count("misses")
                self.metrics.inc("kvblend_misses")
                continue
            out[i] = (hit[0], hit[1], None)
            self._count(f"hits_{hit[0]}")
            self.metrics.inc("kvblend_hits", 1, hit[0])
            if prefetch:
                self._promote_async(parsed[i])
        self.metrics.observe("kvblend_lookup_latency_ms", (time.perf_counter() - t0) * 1e3)
        return out

    def get_refs(self, keys: Sequence[str], timeout_s: float = 5.0) -> list[list | None]:
        """Object refs of the whole chunk objects, promoting from lower tiers as needed.

        One deadline, ``timeout_s`` from the call (issue 20): promotions run on the shard's
        pool and are waited for in parallel, so a stuck tier costs the call ``timeout_s``, not
        that per key; a key not promoted by then is a miss (its promotion goes on).

        Returns:
            Per key ``[ObjectRef]`` (a numpy ``uint8`` array of the encoded object) or None.
        """
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        parsed = [ChunkKey.parse(text) for text in keys]
        out: list[list | None] = [None] * len(parsed)
        waiting: dict[int, tuple[Future, bool]] = {}  # index -> (promotion, already under way)
        for i, key in enumerate(parsed):
            entry = self._host_entry(key)
            if entry is not None:
                with self._lock:
                    was_prefetched = key in self._prefetched
                    self._prefetched.pop(key, None)
                if was_prefetched:
                    self._count("prefetch_hits")
                    self.metrics.inc("kvblend_prefetch_hits")
                out[i] = [entry[0]]
                # the client maps the object from the store: count it as read out of host
                self.metrics.inc("kvblend_bytes_out", entry[2], "host")
                continue
            fut = self._promoting.get(key)
            waiting[i] = (fut, True) if fut is not None else (self._pool.submit(self._promote, key, False), False)
        for i, (fut, prefetched) in waiting.items():
            try:
                ref = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - past the deadline or a tier failure: a miss
                ref = None
            if ref is not None and prefetched:  # the prefetch was already under way: it saved time
                with self._lock:
                    self._prefetched.pop(parsed[i], None)
                self._count("prefetch_hits")
                self.metrics.inc("kvblend_prefetch_hits")
            out[i] = [ref] if ref is not None else None
        self.metrics.observe("kvblend_get_latency_ms", (time.perf_counter() - t0) * 1e3)
        return out

    def put(self, key_text: str, obj: np.ndarray) -> bool:
        """Store one encoded chunk object (numpy ``uint8``; idempotent, first wins).

        The object is validated (header names ``key_text``; every layer's checksum) before
        anything is stored; a bad object returns False and counts ``put_rejected``. Host
        memory is written before returning, lower tiers in the background (see ``drain``),
        unless that backlog is full (``writes_dropped``); False when neither took it.
        """
        key = ChunkKey.parse(key_text)
        if self.host.contains([key])[0]:
            return True
        try:
            header = validate_object(obj, key)
        except FormatError as e:
            log.warning("%s: rejected put of %s: %s", self.name, key, e)
            self._count("put_rejected")
            return False
        self._count("puts")
        stored = self._store_host(key, obj, header.header_end) is not None
        queued = self.lower_stack is not None and self.writes.submit(key, obj, header)
        return stored or queued

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait for background writes to lower tiers (and the stack's copies of promoted
        chunks); True when none is left pending."""
        deadline = time.monotonic() + timeout_s
        if not self.writes.drain(timeout_s):
            return False
        return self.lower_stack is None or self.lower_stack.flush(max(0.0, deadline - time.monotonic()))

    def drain_to_shared(self, timeout_s: float = 300.0) -> int:
        """Before this shard's node is removed: copy every chunk of its host and disk tiers
        that the shared tiers (Redis, S3) lack into them, so other shards and clients still
        find it there (placement moves its keys to other shards; without shared tiers they
        become misses). Returns the number of chunks written; stops at ``timeout_s``."""
        return drain_to_shared(self, timeout_s)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in any of this shard's tiers (no promotion)."""
        parsed = [ChunkKey.parse(k) for k in keys]
        found = [f or self.writes.held(k) is not None for f, k in zip(self.host.contains(parsed), parsed, strict=True)]
        rest = [i for i, f in enumerate(found) if not f]
        if rest and self.lower_stack is not None:
            got = self.lower_stack.contains([parsed[i] for i in rest])
            for i, g in zip(rest, got, strict=True):
                found[i] = g
        return found

    def delete(self, keys: Sequence[str]) -> int:
        """Remove keys from every tier of this shard (shared tiers included); returns how many
        keys were present anywhere."""
        parsed = [ChunkKey.parse(k) for k in keys]
        present = self.contains(keys)
        self.writes.forget(parsed)  # a pending write-down must not bring one back
        self.host.delete(parsed)
        if self.lower_stack is not None:
            self.lower_stack.delete(parsed)  # a failing tier is logged, never raised
        return sum(present)

    def clear(self, namespace: str | None = None, stale: bool = False) -> int:
        """Delete every chunk (of ``namespace`` when given; ``stale``: only objects of another
        format version, never in host memory) from host and disk; returns how many."""
        if not stale:
            self.writes.forget([k for k in self.writes.keys() if namespace is None or k.namespace == namespace])
        n = 0 if stale else self.host.delete([k for k in self.host.keys()
                                              if namespace is None or k.namespace == namespace])
        if self.lower_stack is not None:
            n += self.lower_stack.clear(namespace, stale=stale)  # disk, not Redis/S3
        with self._lock:
            self._prefetched.clear()
        return n

    def stats(self) -> dict:
        """A JSON-able snapshot: identity, cumulative counters and every tier's stats.

        Returns:
            ``{'name', 'node_id', 'node_name', 'pid', 'disk_path'`` (as :meth:`ready`), ``'uptime_s'``
            (seconds since this actor process started), ``'counters': {name: count}``
            (cumulative since it started: lookups, misses, ``hits_<tier>``, read_errors, puts,
            put_rejected, prefetch_started, prefetch_hits, promotions, write_errors,
            writes_dropped, write_behind_hits, lookup_timeouts, ``breaker_<state>`` per breaker change),
            ``'tiers': {tier name: tier.stats()}`` (host first; each tier's own cumulative
            counters and current ``bytes_used``/``capacity_bytes``/``num_chunks``, or
            ``{'error': message}``)``}``. ``kvblend status --json`` prints it per shard;
            the tier stats are also published as gauges every 2 s.
        """
        tiers = {}
        for tier in [self.host, *self.lower]:
            try:
                tiers[tier.name] = tier.stats()
            except Exception as e:  # noqa: BLE001
                tiers[tier.name] = {"error": str(e)}
        with self._lock:
            counters = dict(self.counters)
        return {**self.ready(), "uptime_s": time.time() - self.started_at,
                "counters": counters, "tiers": tiers}

    def _publish_loop(self) -> None:
        while True:
            for tier in [self.host, *self.lower]:
                try:
                    self.metrics.tier_stats(tier.name, tier.stats())
                except Exception:  # noqa: BLE001
                    pass
            time.sleep(2.0)
