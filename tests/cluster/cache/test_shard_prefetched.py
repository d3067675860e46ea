"""The shard's set of prefetched-but-unread chunks stays bounded (issue #20), without Ray:
``CacheShard`` is built in-process with Ray's runtime context, ``ray.put`` and the lower
tiers replaced by stand-ins; its host tier, ``_promote`` and ``get_refs`` are the real ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.cache import shard as shard_mod
from tests.factories import make_key, ray_free_shard, stop_shard
from tiers.config import TiersConfig

pytestmark = pytest.mark.unit

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


class _StuckLower:
    """A lower stack whose reads block until released (a black-holed Redis/S3)."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()

    def find(self, key):
        self.release.wait(BLOCK_S)
        return "redis", OBJECT, SimpleNamespace(header_end=4)


BLOCK_S = 120.0


def test_get_refs_has_one_deadline_over_all_its_promotions(shard):
    """Issue 20: four chunks below host memory in a tier that hangs: ``get_refs`` with
    ``timeout_s`` 0.5 returns misses for all four within the hang guard (before, each key's
    promotion ran in turn on the actor's thread: 4 x 120 s); once the tier answers, the
    promotions that went on land in host memory and the next call serves them."""
    from tests.factories import returns_within

    stuck = _StuckLower()
    shard.lower_stack = stuck
    keys = [str(make_key(i)) for i in range(4)]
    try:
        assert returns_within(shard.get_refs, keys, 0.5, hang_s=30.0) == [None] * 4
    finally:
        stuck.release.set()
    import time

    want = [[f"ref:{k}"] for k in keys]
    deadline = time.monotonic() + 30.0  # a hang guard: the promotions finish once released
    while returns_within(shard.get_refs, keys, 0.5, hang_s=30.0) != want:
        assert time.monotonic() < deadline, "the released promotions never reached host memory"
        time.sleep(0.1)
    assert shard.counters["promotions"] >= 4
