"""The scheduler's view of the cache under tensor parallelism: a chunk hits only when every rank
stored it.

Each tensor-parallel rank stores and loads its own KV heads under its own namespace
(:func:`cluster.namespace.namespace_for` with the rank), while vLLM's scheduler asks one
connector for the whole engine. :class:`AllRanksLookup` stands in for the cache client there:
the connector (:meth:`cluster.vllm.connector.KVBlendConnector._make_client`) wraps its client
in one when ``tensor_parallel_size`` > 1, and the scheduler half
(:class:`cluster.vllm.scheduler.KVBlendScheduler`) looks chunks up through it. No tensors, no vLLM.
"""

from __future__ import annotations

import dataclasses

from tiers.keys import ChunkKey


class AllRanksLookup:
    """The scheduler's view of the cache under tensor parallelism: each rank stores its own
    KV heads under its own namespace, so a chunk counts as a hit only when every rank's copy
    is stored (the same key in each of ``digests``). ``lookup`` ANDs over the ranks and
    returns the first rank's metadata; everything else goes to ``client``.

    Args:
        client: the cache client (``lookup(keys) -> list[ChunkMeta | None]``).
        digests: namespace digests of ranks ``0..tp_size-1``; the keys asked about are in
            ``digests[0]``.
    """

    def __init__(self, client, digests: list[str]) -> None:
        self.client = client
        self.digests = list(digests)

    def lookup(self, keys: list[ChunkKey]) -> list:
        base = self.client.lookup(keys)
        for digest in self.digests[1:]:
            if not any(m is not None for m in base):
                break
            other = self.client.lookup([dataclasses.replace(k, namespace=digest) for k in keys])
            base = [m if o is not None else None for m, o in zip(base, other, strict=True)]
        return base

    def __getattr__(self, name: str):
        return getattr(self.client, name)
