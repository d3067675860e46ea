"""`kvblend bench tiers` reaches a TLS Redis: its own throwaway one (``--redis-tls``) and a
given ``rediss://`` URL, whose CA comes from the kvblend config like every kvblend process's
(``KVBLEND_REDIS_TLS_CA_FILE``). Real TLS-only redis-servers; a chunk makes the round trip."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from cluster.bench import tiers as bench
from tests.factories import make_key, make_kv, make_object

pytestmark = pytest.mark.cluster


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _round_trip(tier) -> None:
    key = make_key(11)
    obj = make_object(key, make_kv(11))
    assert tier.put(key, obj) is True
    assert tier.get(key) == bytes(obj)
    assert tier.stats()["errors"] == 0


def test_bench_starts_its_redis_with_tls():
    with contextlib.ExitStack() as stack:
        tier = bench._make_tier("redis", _args("--redis-tls"), stack, 1, 1 << 16)
        stack.callback(tier.close)
        assert tier._client.connection_pool.connection_kwargs["ssl_ca_certs"]
        _round_trip(tier)


def test_bench_given_a_rediss_url_takes_the_tls_files_from_the_config(private_redis, monkeypatch):
    server = private_redis(tls=True)
    with contextlib.ExitStack() as stack:
        # without the CA the server cannot be verified: misses, counted
        plain = bench._make_tier("redis", _args("--redis-url", server.url), stack, 1, 1 << 16)
        stack.callback(plain.close)
        assert plain.put(make_key(12), make_object(make_key(12), make_kv(12))) is False
        assert plain.stats()["errors"] == 1
        monkeypatch.setenv("KVBLEND_REDIS_TLS_CA_FILE", server.tls.ca_file)
        tier = bench._make_tier("redis", _args("--redis-url", server.url), stack, 1, 1 << 16)
        stack.callback(tier.close)
        _round_trip(tier)
