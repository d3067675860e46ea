"""The shard's set of prefetched-but-unread chunks stays bounded (issue #20), without Ray:
``CacheShard`` is built in-process with Ray's runtime context, ``ray.put`` and the lower
tiers replaced by stand-ins; its host tier, ``_promote`` and ``get_refs`` are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.cache import shard as shard_mod
from tests.factories import make_key, ray_free_shard, stop_shard
from tiers.config import TiersConfig

OBJECT = bytes(16)


class _Lower:
    """A lower stack in which every key is found (the tier a promotion reads from)."""

    def find(self, key):
        return "disk", OBJECT, SimpleNamespace(header_end=4)


@pytest.fixture
def shard(monkeypatch, tmp_path):
    s = ray_free_shard(monkeypatch, tmp_path, TiersConfig(host_size_gib=0.001, disk_size_gib=0.0))
    s.lower_stack = _Lower()
    yield s
    stop_shard(s)


def test_prefetched_set_is_bounded_and_forgets_the_oldest(shard, monkeypatch):
    cap = 8
    # raising=False: on the code before the bound there is no such constant (and no bound)
    monkeypatch.setattr(shard_mod, "MAX_PREFETCHED", cap, raising=False)
    keys = [make_key(i) for i in range(3 * cap)]
    for k in keys:  # background prefetches whose chunks nobody reads
        assert shard._promote(k, True) == f"ref:{k}"
    assert len(shard._prefetched) == cap
    assert set(shard._prefetched) == set(keys[-cap:])

    refs = shard.get_refs([str(k) for k in keys])
    assert refs == [[f"ref:{k}"] for k in keys]  # every chunk is still served from host memory
    # only the prefetches still remembered count as hits; the forgotten ones lose just that
    assert shard.counters["prefetch_hits"] == cap
    assert len(shard._prefetched) == 0


def test_a_served_prefetch_is_counted_once_and_a_plain_promotion_never(shard, monkeypatch):
    monkeypatch.setattr(shard_mod, "MAX_PREFETCHED", 8, raising=False)
    a, b = make_key(1), make_key(2)
    shard._promote(a, True)
    shard._promote(b, False)  # a read's own promotion: not a prefetch
    shard.get_refs([str(a), str(b), str(a)])
    assert shard.counters["prefetch_hits"] == 1
    assert len(shard._prefetched) == 0
