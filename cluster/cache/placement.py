"""Which shard owns a chunk: rendezvous (highest-random-weight) hashing over shard names.

HRW (Thaler & Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM ToN
1998): every (shard, key) pair gets a pseudo-random weight ``xxh3_64(shard + "\\0" + key)``;
the key's owner is the shard with the highest weight. Properties this module relies on and
``tests/cluster/cache/test_placement.py`` checks:

* every process computes the same owner from the same set of shard names (no coordination,
  no shared state; names are ``kvblend-shard-<node name>@<node id>-<i>`` and survive actor
  restarts);
* weights use the shard's *placement name*, its actor name without ``@<node id>``
  (:func:`placement_name`): a shard restarted on a new Ray node of the same machine (a raylet
  or pod restart gives a new node id; the node name stays, :mod:`cluster.cache.identity`) owns
  the same keys as before, the ones its disk directory holds;
* load is even: with 10,000 keys over 3 shards the busiest shard holds <= 1.15x the mean;
* adding an N-th shard moves only the keys it now wins (about 1/N of them); removing one
  moves only that shard's keys.

Decision on moved keys: they **become misses** (no background migration). The old owner keeps
the bytes until its LRU/LFU evicts them and the shared Redis/S3 tiers below every shard still
serve them, so a moved key costs one read from Redis/S3 or, without those, one recompute. The
client counts them (``stats()['client']['placement_moves']``) by comparing the previous and
new owner of every key it has cached metadata for when the shard set changes.

Bookkeeping only: no torch, no Ray.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import xxhash

_NODE_ID = re.compile(r"@[0-9a-f]+(?=-\d+$)")


def placement_name(shard: str) -> str:
    """``kvblend-shard-<node name>-<i>`` for ``kvblend-shard-<node name>@<node id>-<i>``; a
    name without ``@`` (shards named before node names) is its own placement name."""
    return _NODE_ID.sub("", shard)


def weight(shard: str, key: str) -> int:
    """The HRW weight of ``key`` on ``shard`` (a 64-bit int, stable across processes and
    across restarts of the shard on a new Ray node: see :func:`placement_name`)."""
    return xxhash.xxh3_64_intdigest(f"{placement_name(shard)}\0{key}".encode())


def owner(key: str, shards: Sequence[str]) -> str:
    """The shard that owns ``key``.

    Raises:
        ValueError: ``shards`` is empty.
    """
    if not shards:
        raise ValueError("no shards to place a key on")
    best, best_w = shards[0], -1
    for s in shards:
        w = weight(s, key)
        if w > best_w or (w == best_w and s < best):
            best, best_w = s, w
    return best


class Placement:
    """An immutable placement over a set of shard names.

    Args:
        shards: shard names (order and duplicates do not matter).

    Raises:
        ValueError: no shards.
    """

    def __init__(self, shards: Iterable[str]) -> None:
        self.shards: tuple[str, ...] = tuple(sorted(set(shards)))
        if not self.shards:
            raise ValueError("a placement needs at least one shard")

    def owner(self, key: str) -> str:
        """Owner of one key (``str(ChunkKey)``)."""
        return owner(key, self.shards)

    def group(self, keys: Sequence[str]) -> dict[str, list[int]]:
        """Indices of ``keys`` per owning shard (one batch per shard: one round trip each)."""
        out: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            out.setdefault(self.owner(k), []).append(i)
        return out

    def load(self, keys: Iterable[str]) -> dict[str, int]:
        """Number of keys each shard owns (every shard listed, zeros included)."""
        counts = dict.fromkeys(self.shards, 0)
        for k in keys:
            counts[self.owner(k)] += 1
        return counts

    def moved(self, other: Placement, keys: Iterable[str]) -> int:
        """How many of ``keys`` have a different owner under ``other``."""
        return sum(1 for k in keys if self.owner(k) != other.owner(k))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self.shards == other.shards

    def __hash__(self) -> int:
        return hash(self.shards)

    def __repr__(self) -> str:
        return f"Placement({list(self.shards)})"
