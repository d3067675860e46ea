"""Before a cache node is removed: its shard's chunks go to the shared tiers (Redis, S3), so
other shards and clients still find them there (placement moves the node's keys to other
shards; without shared tiers they become misses). ``kvblend stop --drain`` runs it through
:meth:`cluster.cache.shard.CacheShard.drain_to_shared`.
"""

from __future__ import annotations

import time

from tiers.format import FormatError
from tiers.keys import ChunkKey
from tiers.reader import validate_object


def drain_to_shared(shard, timeout_s: float) -> int:
    """Copy every chunk of ``shard``'s host and disk tiers that its shared tiers lack into them
    (lz4-encoded once, by its lower stack). Returns the number of chunks written; stops at
    ``timeout_s``. A chunk that fails validation is skipped and counted ``read_errors``."""
    if not shard.shared:
        return 0
    deadline = time.monotonic() + timeout_s
    written = 0
    local = [shard.host] + ([shard.disk] if shard.disk is not None else [])
    names = [t.name for t in shard.shared]
    seen: set[ChunkKey] = set()
    for tier in local:
        for key in tier.keys():
            if key in seen or time.monotonic() > deadline:
                continue
            seen.add(key)
            if all(t.contains([key])[0] for t in shard.shared):
                continue
            if tier is shard.host:
                entry = shard.host.get_object(key)
                if entry is None:
                    continue
                import ray

                obj = ray.get(entry[0])
            else:
                obj = tier.get(key)
            if obj is None:
                continue
            try:
                header = validate_object(obj, key)
            except FormatError:
                shard._count("read_errors")
                continue
            if all(shard.lower_stack.store(key, obj, names, header=header).values()):
                written += 1
    return written
