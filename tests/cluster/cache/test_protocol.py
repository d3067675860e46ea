"""Both cache clients keep the one contract of ``cluster.cache.protocol.CacheClientProtocol``:
every member with the protocol's parameters (statically, no Ray), ``isinstance`` of the
machine-local client, and its ``close`` really closing the tier it owns. The Ray client's
``isinstance`` check runs against live shards in ``test_client.py``."""

from __future__ import annotations

import inspect
from typing import Protocol

import pytest
import torch

from blend.protocols import KVSink, KVSource
from cluster.cache.client import CacheClient
from cluster.cache.local import LocalCacheClient
from cluster.cache.protocol import CacheClientProtocol
from tests.factories import make_key, make_object, shard_kv

pytestmark = pytest.mark.unit

CONTRACT = {"lookup", "fetch_layers", "fetch_layer", "host_layers", "put", "flush", "contains", "delete", "stats", "close"}


def _protocol_members(proto: type) -> set[str]:
    return {name for cls in proto.__mro__ if cls not in (object, Protocol) and Protocol in cls.__mro__
            for name in vars(cls) if not name.startswith("_")}


def test_protocol_extends_kv_source_and_sink_with_the_contract():
    assert issubclass(CacheClientProtocol, KVSource) and issubclass(CacheClientProtocol, KVSink)
    assert _protocol_members(CacheClientProtocol) == CONTRACT


@pytest.mark.parametrize("impl", [CacheClient, LocalCacheClient])
def test_both_clients_have_every_member_with_the_protocols_parameters(impl):
    for name in sorted(CONTRACT):
        want = inspect.signature(getattr(CacheClientProtocol, name)).parameters
        got = inspect.signature(getattr(impl, name)).parameters
        assert [(p.name, p.kind, p.default) for p in got.values()] == \
            [(p.name, p.kind, p.default) for p in want.values()], f"{impl.__name__}.{name}"


def test_local_client_is_a_cache_client():
    client = LocalCacheClient()
    assert isinstance(client, CacheClientProtocol)
    assert isinstance(client, KVSource) and isinstance(client, KVSink)
    assert not isinstance(object(), CacheClientProtocol)


def test_local_client_raises_the_protocols_caller_mistakes():
    client = LocalCacheClient()
    with pytest.raises(TypeError, match="ChunkKey"):
        client.lookup(["not-a-key"])
    with pytest.raises(TypeError, match="ChunkKey"):
        client.put("not-a-key", shard_kv(0))
    with pytest.raises(ValueError, match="layer_idx=-1"):
        client.fetch_layer([make_key(1)], -1)
    with pytest.raises(ValueError, match=r"\[L, 2, T, H, D\]"):
        client.put(make_key(1), torch.zeros(2, 3, 4))


def test_local_client_close_flushes_and_stops_its_tier_stack(tmp_path):
    from tiers.disk import DiskTier
    from tiers.host import HostTier
    from tiers.stack import TierStack

    disk = DiskTier(str(tmp_path / "disk"), 1 << 24, fsync=False)
    stack = TierStack([HostTier(1 << 24), disk], compression="lz4")
    client = LocalCacheClient(stack)
    keys = [make_key(10 + i) for i in range(6)]
    for i, k in enumerate(keys):
        client.put(k, shard_kv(i))
    client.close()
    assert disk.contains(keys) == [True] * len(keys)  # the write-downs finished before close returned
    late = make_key(99)
    with pytest.raises(RuntimeError):  # the stack's threads are stopped: no new write-down
        stack.put(late, make_object(late, shard_kv(99)))
