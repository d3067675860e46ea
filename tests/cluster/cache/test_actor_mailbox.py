"""The shard actor's mailbox is bounded by the client (issue 20: "the Ray actor mailbox ... are
unbounded"). Ray queues a call to an actor that does not run — here every shard of the session
cluster SIGSTOPped — without limit, with its arguments in the object store; the only bound is
how many calls a client leaves unsettled (:data:`cluster.cache.puts.MAX_PENDING_PUTS`, set to
8 here). Puts past it are dropped and counted, and every put returns at once; after SIGCONT the
shards run exactly the calls that were queued, so the mailbox never held more than the bound."""

from __future__ import annotations

import contextlib

import pytest

from cluster.cache import puts as puts_mod
from cluster.workloads.faults import sigstopped
from tests.factories import NAMESPACE, make_key, returns_within, shard_kv

pytestmark = pytest.mark.cluster

#: the bound in this test (the default, 256, would need 256 chunks)
BOUND = 8
#: puts sent while the shards are stopped
SENT = 30


def _shard_puts(client) -> int:
    return sum(int(s.get("counters", {}).get("puts", 0)) for s in client.stats()["shards"].values())


def test_a_stopped_shards_mailbox_holds_at_most_the_pending_put_bound(kvconfig, shards, monkeypatch):
    import ray

    from cluster.cache.client import CacheClient
    from cluster.cache.lifecycle import get_shard

    monkeypatch.setattr(puts_mod, "MAX_PENDING_PUTS", BOUND)
    client = CacheClient(kvconfig, namespace=NAMESPACE)
    try:
        pids = [ray.get(get_shard(n, kvconfig.cluster.ray_namespace).ready.remote(), timeout=60)["pid"]
                for n in shards]
        before = _shard_puts(client)
        keys = [make_key(98100 + i) for i in range(SENT)]
        with contextlib.ExitStack() as frozen:
            for pid in pids:
                frozen.enter_context(sigstopped(pid))
            for i, key in enumerate(keys):
                # never waits for the stopped shard: a hang guard, the only timing
                returns_within(client.put, key, shard_kv(i, num_tokens=4), what="a put to a stopped shard")
            assert client.counters["puts"] == BOUND, client.counters
            assert client.counters["puts_dropped"] == SENT - BOUND, client.counters
            assert not client.flush(0.5), "the queued puts cannot settle while the shards are stopped"
        assert client.flush(60), "the queued puts settle once the shards run again"
        # exactly the calls that were queued reached the shards: the mailbox held BOUND
        assert _shard_puts(client) - before == BOUND
        assert client.contains(keys) == [True] * BOUND + [False] * (SENT - BOUND)
        assert client.counters["put_errors"] == 0
    finally:
        client.delete([make_key(98100 + i) for i in range(SENT)])
        client.close()
