"""Tensor parallelism on the scheduler side: a chunk hits only when every rank stored it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cluster.cache.local import LocalCacheClient
from cluster.vllm.tp_lookup import AllRanksLookup
from tiers.keys import ChunkKey

pytestmark = pytest.mark.unit

RANKS = ["aa" * 8, "bb" * 8]


def _key(i: int, rank: int = 0) -> ChunkKey:
    return ChunkKey(RANKS[rank], "pre", f"{i:032x}")


def test_a_chunk_hits_only_when_every_rank_stored_it():
    client = LocalCacheClient()
    kv = torch.randn(2, 2, 4, 1, 8)  # [L, 2, T, H, D]: this rank's heads
    client.put(_key(0, 0), kv)
    client.put(_key(0, 1), kv)
    client.put(_key(1, 0), kv)     # rank 1 never stored chunk 1
    client.put(_key(2, 1), kv)     # rank 0 never stored chunk 2
    assert client.flush(10)
    view = AllRanksLookup(client, RANKS)
    metas = view.lookup([_key(0), _key(1), _key(2), _key(3)])
    assert [m is not None for m in metas] == [True, False, False, False]
    assert metas[0].num_tokens == 4
    # everything else is the client's
    assert view.contains([_key(1)]) == [True]
    assert view.lookup([dataclasses.replace(_key(0), namespace=RANKS[0])])[0] is not None
