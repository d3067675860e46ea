r"""``RayTransport``: the shard actors, called from this process (a Ray driver).

The :class:`~cluster.cache.ops.Transport` of the in-process client (``ray_client: driver``, the
CLI, ingest, benchmarks) and of the cache agent, which hands it every request it gets
(:mod:`cluster.cache.agent`)::

    lookup    one lookup call per owning shard, all in parallel, waited for lookup_wait_s
              (a late shard's keys are misses; a failed one's are ``unanswered``); the shards
              start promoting hits into host memory and send each header once per client
    objects   one get_refs call per owning shard, in parallel, then one batched ray.get of the
              whole objects (zero-copy from the node's object store on the same node)
    put       ShardWriter: the owner's put.remote with the encoded object as it came
    contains, delete, clear, stats, flush   one call per (owning) shard

Placement: rendezvous hashing (:mod:`cluster.cache.placement`) of ``str(ChunkKey)`` over the
shard actors of ``ray_namespace``, kept by a :class:`~cluster.cache.router.ShardRouter`
(re-read every :data:`~cluster.cache.router.REFRESH_S` s and after a failed call); when the
shard set changes the client forgets the keys whose owner moved (they become misses,
``placement_moves``).

Refs are not returned by ``lookup`` (each returned ref costs Ray a borrower registration: 16
refs added ~5 ms to a 1 ms call on the dev box) nor kept after ``objects`` (a mapped array
holds its object pinned in the node's object store while the client keeps it).

Failure behaviour: every shard call waits at most ``call_timeout_s`` (a lookup: its
:func:`~cluster.cache.deadline.lookup_wait_s`); a timeout, a dead or restarting shard or a lost
object is a miss and a counter (``timeouts``, ``shard_errors``), never an exception. A failed
shard is skipped for :data:`~cluster.cache.router.SUSPECT_S` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from cluster.cache.connect import connect
from cluster.cache.deadline import lookup_wait_s
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
from cluster.cache.puts import ShardWriter
from cluster.cache.router import ShardRouter

log = logging.getLogger("kvblend.client")


class RayTransport:
    """The shard actors of ``config.cluster.ray_namespace`` (see the module docstring).

    Args:
        config: a :class:`cluster.config.KVBlendConfig` (``ray_address``, ``ray_namespace``,
            ``call_timeout_s``, ``lookup_timeout_s``).
        max_mapped_bytes: bytes of mapped objects the client keeps between requests (each
            stays pinned in the node's object store while kept).

    Raises:
        ConnectionError: Ray is not reachable (:func:`cluster.cache.factory.make_client` falls
            back to a machine-local cache instead).
    """

    name = "ray"
    counters = ("shard_errors", "put_errors", "placement_moves")
    remote = True
    compress = False
    threaded = True

    def __init__(self, config, max_mapped_bytes: int) -> None:
        if connect(config.cluster) is None:
            raise ConnectionError(f"Ray is not reachable at ray_address={config.cluster.ray_address!r}")
        self.config = config
        self.timeout_s = config.cluster.call_timeout_s
        self.keep_bytes = int(max_mapped_bytes)
        self._count: Callable[[str, int], None] = lambda name, n=1: None
        self._host = None
        #: the shard set: placement, handles, suspects (tests and benchmarks read its placement)
        self.router = ShardRouter(config.cluster.ray_namespace, self.timeout_s, self._counted, self._moved)
        self.writer = ShardWriter(self.router, self._counted)
        self.router.refresh(force=True)

    def bind(self, host) -> None:
        """The client's counters and its header cache's placement hook (see the Transport)."""
        self._host = host
        self._count = host.count

    def _counted(self, name: str, n: int = 1) -> None:
        self._count(name, n)

    def _moved(self, old, new) -> None:
        if old is not None and new is not None and self._host is not None:
            self._host.placement_changed(new.owner)

    @property
    def up(self) -> bool:
        return True

    def lookup(self, request: LookupRequest) -> LookupAnswer:
        keys = request.keys
        known = request.known or (False,) * len(keys)
        groups = self.router.groups(keys)
        late: set[str] = set()  # slow shards (lookup_timeout_s + margin): misses, no direct reads
        results = self.router.call(groups, "lookup", lambda idx: (
            [str(keys[i]) for i in idx], True, False, [known[i] for i in idx]), lookup_wait_s(self.config), late)
        hits: list[LookupHit | None] = [None] * len(keys)
        unanswered: list[int] = [] if groups else list(range(len(keys)))
        for name, idx in groups.items():
            res = results.get(name)
            if res is None:
                unanswered.extend([] if name in late else idx)
                continue
            for i, hit in zip(idx, res, strict=False):
                if hit is not None:  # (tier, header bytes, refs: never asked for)
                    hits[i] = LookupHit(hit[0], bytes(hit[1]), name)
        return LookupAnswer(tuple(hits), tuple(sorted(unanswered)))

    def objects(self, request: ObjectsRequest) -> ObjectsAnswer:
        """The owners' host-memory objects of ``request.keys``: one ``get_refs`` call per shard
        (promoting from lower tiers as needed), then one batched ``ray.get`` (one by one when it
        fails, to find which); every wait within ``min(call_timeout_s, request.timeout_s)``."""
        import ray

        keys = request.keys
        timeout_s = min(self.timeout_s, request.timeout_s) if request.timeout_s > 0 else self.timeout_s
        fetch, refs = self.refs(keys, timeout_s)
        objects: list = [None] * len(keys)
        deadline = time.monotonic() + timeout_s  # the batch and the one-by-one retry share it
        try:  # one batched get (0.3 ms per ref saved under load, measured in the bench)
            got = ray.get(refs, timeout=timeout_s) if refs else []
        except Exception:  # noqa: BLE001 - find which one failed, one by one
            got = []
            for i, ref in zip(fetch, refs, strict=True):
                try:  # timeout 0 past the deadline: an object already local is still taken
                    got.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
                except Exception as e:  # noqa: BLE001 - owner died / object lost / slow
                    log.debug("object of %s unavailable: %r", keys[i], e)
                    self._count("shard_errors", 1)
                    got.append(None)
        for i, arr in zip(fetch, got, strict=True):
            objects[i] = arr
        # a shard's host memory holds only objects whose every layer it checked as they came
        return ObjectsAnswer(tuple(objects), (True,) * len(keys))

    def refs(self, keys, timeout_s: float) -> tuple[list[int], list]:
        """``(indexes, ObjectRefs)`` of the keys whose owner answered ``get_refs`` with one
        (one call per owning shard, in parallel, within ``timeout_s``)."""
        groups = self.router.groups(keys)
        results = self.router.call(groups, "get_refs", lambda idx: ([str(keys[i]) for i in idx], timeout_s), timeout_s)
        fetch, refs = [], []
        for name, idx in groups.items():
            for i, got in zip(idx, results.get(name) or [], strict=False):
                if got is not None:
                    fetch.append(i)
                    refs.append(got[0])
        return fetch, refs

    def put(self, request: PutRequest, done: Callable[[bool], None]) -> bool:
        return self.writer.send(request.key, request.obj, done)

    def in_flight(self, key) -> bool:
        """Whether a put of ``key`` has not settled yet."""
        return self.writer.in_flight(key)

    def flush(self, request: FlushRequest) -> bool:
        """:meth:`cluster.cache.puts.ShardWriter.flush` (says exactly when it is False)."""
        return self.writer.flush(request.timeout_s)

    def contains(self, request: KeysRequest) -> tuple[bool, ...]:
        keys = request.keys
        groups = self.router.groups(keys)
        results = self.router.call(groups, "contains", lambda idx: ([str(keys[i]) for i in idx],))
        out = [False] * len(keys)
        for name, idx in groups.items():
            for i, c in zip(idx, results.get(name) or [], strict=False):
                out[i] = bool(c)
        return tuple(out)

    def delete(self, request: KeysRequest) -> int:
        """Delete keys from their shards (and the shared tiers); how many existed (where answered)."""
        keys = request.keys
        groups = self.router.groups(keys)
        results = self.router.call(groups, "delete", lambda idx: ([str(keys[i]) for i in idx],))
        return int(sum(results.values()))

    def clear(self, request: ClearRequest) -> int:
        """``clear(namespace, stale)`` on every shard (those that do not answer are skipped)."""
        return int(sum(self.router.call_all("clear", request.namespace, request.stale).values()))

    def stats(self, request: StatsRequest) -> dict:
        """``{'shards': {shard name: CacheShard.stats()}}`` of every shard that answers within
        ``call_timeout_s`` (see :meth:`cluster.cache.shard.CacheShard.stats`)."""
        return {"shards": self.router.call_all("stats")}

    def close(self) -> None:
        """Nothing to release: puts already sent keep running on the shards."""
