"""``ShardRouter``: which shard owns a key, and one batched call per shard under one deadline.

The client's view of the shard set (used by :class:`cluster.cache.client.CacheClient` and its
:class:`cluster.cache.puts.ShardWriter`)::

    refresh()   shard actor names in ``ray_namespace`` -> a Placement, at most every REFRESH_S s
                (and at once after a failed call); on_change(old, new) when the set changes
    groups()    keys -> {owner shard: [key indices]} (rendezvous hashing, cluster.cache.placement)
    call()      method.remote(...) on every owner at once, then ray.get each within one deadline

Failure behaviour: a shard whose call raises or times out is absent from :meth:`call`'s result,
counted (``timeouts`` or ``shard_errors``) and skipped for :data:`SUSPECT_S` seconds; its actor
handle is dropped and the shard list re-read at the next call — except a late answer to a
call given ``late`` (lookups), which is only counted. Listing the shards failing
(a GCS hiccup) keeps the previous placement. Nothing here raises for a cache fault.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from cluster.cache.lifecycle import get_shard, shard_names
from cluster.cache.placement import Placement
from tiers.keys import ChunkKey

log = logging.getLogger("kvblend.client")

#: seconds between two readings of the shard list (a failed call forces the next one)
REFRESH_S = 5.0
#: seconds a shard whose call failed is left out (its keys are then misses or direct reads)
SUSPECT_S = 2.0


class ShardRouter:
    """Placement, actor handles and suspects of the shards in one Ray namespace.

    Args:
        ray_namespace: the Ray namespace of the shard actors.
        timeout_s: the deadline of one :meth:`call` (all shards together), seconds.
        count: ``count(counter_name, n)`` — adds to the owner's counters (``timeouts``,
            ``shard_errors``).
        on_change: ``on_change(old, new)`` — called by :meth:`refresh` before a new placement
            replaces the old one (either may be None: no shard registered).

    The client calls it from its callers' and its pool's threads without a lock: each step is
    one dict operation or an idempotent re-read, so a race costs at most one extra reading of
    the shard list.
    """

    def __init__(self, ray_namespace: str, timeout_s: float, count: Callable[[str, int], None],
                 on_change: Callable[[Placement | None, Placement | None], None]) -> None:
        self.ray_namespace = ray_namespace
        self.timeout_s = timeout_s
        self.placement: Placement | None = None
        #: shard name -> actor handle, filled on first use, dropped after a failed call
        self.handles: dict[str, object] = {}
        #: shard name -> ``time.monotonic()`` before which it is not called
        self.suspect: dict[str, float] = {}
        self._count = count
        self._on_change = on_change
        self._refreshed_at = 0.0

    def refresh(self, force: bool = False) -> Placement | None:
        """The current placement, re-read from Ray when older than :data:`REFRESH_S` (or
        ``force``); None when no shard is registered."""
        now = time.monotonic()
        if not force and now - self._refreshed_at < REFRESH_S:
            return self.placement
        try:
            names = shard_names(self.ray_namespace)
        except Exception as e:  # noqa: BLE001 - GCS hiccup: keep the old placement
            log.debug("listing shards failed: %s", e)
            return self.placement
        self._refreshed_at = now
        new = Placement(names) if names else None
        old = self.placement
        if new != old:
            self._on_change(old, new)
            log.info("kvblend shards: %s", list(new.shards) if new else [])
            self.placement = new
        return self.placement

    def handle(self, name: str):
        """The actor handle of shard ``name`` (cached), or None when the actor does not exist."""
        h = self.handles.get(name)
        if h is None:
            h = get_shard(name, self.ray_namespace)
            if h is not None:
                self.handles[name] = h
        return h

    def usable(self, name: str) -> bool:
        """False while ``name`` is suspect (a call to it failed less than SUSPECT_S ago)."""
        return time.monotonic() >= self.suspect.get(name, 0.0)

    def failed(self, name: str, err: Exception) -> None:
        """Count a failed call to ``name``, make it suspect and re-read the shard list next."""
        import ray

        self._count("timeouts" if isinstance(err, ray.exceptions.GetTimeoutError) else "shard_errors", 1)
        self.suspect[name] = time.monotonic() + SUSPECT_S
        self.handles.pop(name, None)
        self._refreshed_at = 0.0
        log.debug("shard %s call failed: %r", name, err)

    def groups(self, keys: Sequence[ChunkKey]) -> dict[str, list[int]]:
        """``{owner shard: [indices into keys]}``; empty when no shard is registered."""
        p = self.refresh()
        if p is None:
            return {}
        return p.group([str(k) for k in keys])

    def call(self, groups: dict[str, list[int]], method: str,
             args_for: Callable[[list[int]], tuple], timeout_s: float | None = None,
             late: set[str] | None = None) -> dict[str, object]:
        """Call ``method(*args_for(indices))`` on every shard in ``groups`` at once and gather
        the results within ``timeout_s`` (default: the router's).

        Args:
            late: when given, a shard whose answer is not back by the deadline is added to it
                and counted (``timeouts``) but not marked suspect: slow once is not failed
                (lookups: the shard answers by ``lookup_timeout_s`` unless it is overloaded).

        Returns:
            ``{shard name: result}``; shards that are suspect, gone, failed or late are absent
            (and marked suspect when their call failed, or timed out without ``late``).
        """
        import ray

        refs = {}
        for name, idx in groups.items():
            h = self.handle(name) if self.usable(name) else None
            if h is None:
                continue
            try:
                refs[name] = getattr(h, method).remote(*args_for(idx))
            except Exception as e:  # noqa: BLE001
                self.failed(name, e)
        out = {}
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError as e:  # slow shard: a miss
                if late is None:
                    self.failed(name, e)
                else:
                    late.add(name)
                    self._count("timeouts", 1)
                    log.debug("shard %s answered %s late: its keys are misses", name, method)
            except Exception as e:  # noqa: BLE001 - dead or restarting shard: a miss
                self.failed(name, e)
        return out

    def call_all(self, method: str, *args) -> dict[str, object]:
        """``method(*args)`` on every registered shard (the shard list re-read first); see
        :meth:`call` for the result."""
        p = self.refresh(force=True)
        if p is None:
            return {}
        return self.call({name: [] for name in p.shards}, method, lambda _idx: args)
