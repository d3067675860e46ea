"""The Redis tier over TLS against a real TLS-only redis-server (issue 19).

Every server here is ``redis-server --port 0 --tls-port <free>`` with certificates of a throwaway
CA (``private_redis(tls=True)``, :func:`cluster.workloads.services.make_tls_files`); nothing is
mocked. A client that cannot verify the server (no CA, a wrong CA) or that the server refuses
(no client certificate, one of a foreign CA) gets misses counted in ``stats()['errors']``,
never an exception; the same tier object then works against the same server once it is given
the right files, so the failures were TLS's and not a dead server's.
"""

from __future__ import annotations

import logging

import pytest

from tests.factories import as_layer, layer_buffers, make_key, make_kv, make_object
from tiers.config import TiersConfig
from tiers.lower import shared_tiers
from tiers.reader import read_layers
from tiers.redis_tier import RedisTier

pytestmark = pytest.mark.cluster


def _assert_misses(tier: RedisTier, key) -> None:
    """Every call is a miss or a failed write, counted as an error, and none raises."""
    before = tier.stats()["errors"]
    obj = make_object(key, make_kv())
    assert tier.put(key, obj) is False
    assert tier.get(key) is None
    assert tier.head(key, 64) is None
    assert tier.get_ranges(key, [(0, 8)]) is None
    assert tier.contains([key]) == [False]
    assert tier.delete([key]) == 0
    assert tier.stats()["errors"] - before == 6
    assert tier.stats()["puts"] == 0 and tier.stats()["hits"] == 0


def _round_trip(tier: RedisTier, seed: int) -> None:
    """A chunk object put and read back byte-identical, whole and layer by layer."""
    key, kv = make_key(seed), make_kv(seed)
    obj = make_object(key, kv)
    assert tier.put(key, obj) is True
    assert tier.get(key) == bytes(obj)
    assert tier.contains([key, make_key(seed + 1000)]) == [True, False]
    outs = layer_buffers(kv)
    assert read_layers(tier, key, range(kv.shape[0]), outs) is not None
    for i in range(kv.shape[0]):
        assert as_layer(outs[i], kv[i]).equal(kv[i])


def test_redis_tier_over_tls_with_the_ca_round_trips_a_chunk(private_redis):
    server = private_redis(tls=True)
    assert server.url.startswith("rediss://127.0.0.1:")
    cfg = TiersConfig(**server.config_values())
    assert cfg.redis_tls_ca_file == server.tls.ca_file
    (tier,) = shared_tiers(cfg)  # the product's way to open it (shards, clients, clear)
    try:
        _round_trip(tier, 1)
        assert tier.stats()["errors"] == 0
    finally:
        tier.close()


def test_redis_tls_without_the_ca_or_with_a_wrong_one_is_a_counted_miss(private_redis, foreign_tls_files):
    server = private_redis(tls=True)
    key = make_key(2)
    no_ca = RedisTier(server.url, timeout_s=2.0)  # the system's trust store: not our CA
    wrong_ca = RedisTier(server.url, timeout_s=2.0, tls_ca_file=foreign_tls_files.ca_file)
    right_ca = RedisTier(server.url, timeout_s=2.0, tls_ca_file=server.tls.ca_file)
    try:
        _assert_misses(no_ca, key)
        _assert_misses(wrong_ca, key)
        _round_trip(right_ca, 3)  # the server was fine all along
        assert right_ca.stats()["errors"] == 0
    finally:
        for t in (no_ca, wrong_ca, right_ca):
            t.close()


def test_redis_tls_auth_clients_yes_takes_our_client_certificate(private_redis, foreign_tls_files, caplog):
    server = private_redis(tls=True, tls_auth_clients="yes")
    values = server.config_values()
    assert values["redis_tls_cert_file"] == server.tls.client_cert_file
    key = make_key(4)
    ca = server.tls.ca_file
    no_cert = RedisTier(server.url, timeout_s=2.0, tls_ca_file=ca)
    foreign_cert = RedisTier(server.url, timeout_s=2.0, tls_ca_file=ca,
                             tls_cert_file=foreign_tls_files.client_cert_file,
                             tls_key_file=foreign_tls_files.client_key_file)
    (ours,) = shared_tiers(TiersConfig(**values))
    try:
        with caplog.at_level(logging.DEBUG, logger="tiers.redis_tier"):
            _assert_misses(no_cert, key)
            _assert_misses(foreign_cert, key)
        _round_trip(ours, 5)
        assert ours.stats()["errors"] == 0
    finally:
        for t in (no_cert, foreign_cert, ours):
            t.close()
    # the failures were logged (debug), the private keys' contents never
    assert "redis tier put" in caplog.text
    for path in (foreign_tls_files.client_key_file, server.tls.client_key_file):
        body = open(path).read().splitlines()[1]  # a line of the base64 key
        assert body not in caplog.text


def test_tls_settings_that_cannot_work_stop_start_up(tmp_path, foreign_tls_files, caplog):
    """A TLS file with a redis:// URL or a client key without its certificate is a config
    error naming the field (never the URL's password); an unreadable file stops the tier from
    opening (shared_tiers leaves it out with a warning naming the path)."""
    ca = foreign_tls_files.ca_file
    plain = "redis://:hunter2pw@127.0.0.1:6379/0"
    for name in ("redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file"):
        with pytest.raises(ValueError, match=rf"^{name}=.*rediss://") as info:
            TiersConfig(redis_url=plain, **{name: ca})
        assert "hunter2pw" not in str(info.value)
    tls_url = "rediss://:hunter2pw@127.0.0.1:6379/0"
    with pytest.raises(ValueError, match=r"^redis_tls_key_file=.*without redis_tls_cert_file"):
        TiersConfig(redis_url=tls_url, redis_tls_key_file=foreign_tls_files.client_key_file)
    assert TiersConfig(redis_url="", redis_tls_ca_file=ca).redis_tls_ca_file == ca  # no Redis tier
    with pytest.raises(ValueError, match="tls_ca_file"):
        RedisTier("redis://127.0.0.1:6379/0", tls_ca_file=ca)
    missing = str(tmp_path / "no-such-ca.crt")
    with pytest.raises(ValueError, match="tls_ca_file=.*no-such-ca.crt.*not a readable file"):
        RedisTier(tls_url, tls_ca_file=missing)
    with caplog.at_level(logging.WARNING, logger="tiers.lower"):
        assert shared_tiers(TiersConfig(redis_url=tls_url, redis_tls_ca_file=missing)) == []
    assert "no-such-ca.crt" in caplog.text and "hunter2pw" not in caplog.text
