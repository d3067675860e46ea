"""Issue 37 item 5: any Redis password works, and none is ever shown.

Against a real redis-server whose ``requirepass`` is set at run time (``CONFIG SET``: the
password is in no process's argv): a password with ``/``, ``#``, ``@``, ``%`` and spaces works
percent-encoded in the URL, whole in ``redis_password`` (``$KVBLEND_REDIS_PASSWORD``) and in the
file ``redis_password_file`` names (``$KVBLEND_REDIS_PASSWORD_FILE``), through the tier, the
shared-tier set-up the shards use and ``kvblend clear --shared``; written into the URL
unencoded it is refused with a message and a warning that hold no part of it (urllib's
``Port could not be cast to integer value as '<first part>'`` used to reach the warning)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from urllib.parse import quote

import pytest

from tests.factories import layer_buffers, make_key, make_kv, make_object
from tiers.config import TiersConfig
from tiers.lower import shared_tiers
from tiers.reader import read_layers
from tiers.redis_tier import RedisTier

pytestmark = pytest.mark.cluster

PASSWORDS = ["S3cr3t/x", "S3cr3t#x", "S3cr3t@x", "S3cr3t%x", "S3cr3t x", "S3cr3t/#@% ?x%41"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _parts(password: str) -> list[str]:
    """The pieces of ``password`` between its special characters (what a parser cut out)."""
    return [p for p in re.split(r"[/#@%? ]", password) if len(p) >= 4]


def _assert_hidden(text: str, password: str) -> None:
    for part in [password, *_parts(password)]:
        assert part not in text, f"a part of the password ({len(part)} chars) shows"


@pytest.fixture
def guarded(private_redis):
    """``guarded(password)``: a fresh redis-server requiring ``password``; returns its URL
    without userinfo."""

    def start(password: str) -> str:
        import redis

        server = private_redis()
        redis.Redis.from_url(server.url).config_set("requirepass", password)
        return server.url

    return start


def _round_trip(tier: RedisTier, seed: int) -> None:
    key, kv = make_key(seed), make_kv(seed)
    assert tier.put(key, make_object(key, kv))
    assert read_layers(tier, key, range(kv.shape[0]), layer_buffers(kv)) is not None
    assert tier.stats()["errors"] == 0


@pytest.mark.parametrize("password", PASSWORDS)
def test_any_password_works_encoded_in_the_url_or_whole_apart_and_is_never_shown(
        guarded, password, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    url = guarded(password)
    encoded = url.replace("redis://", f"redis://:{quote(password, safe='')}@")
    _round_trip(RedisTier(encoded), 1)
    _round_trip(RedisTier.from_config(TiersConfig(redis_url=url, redis_password=password)), 2)
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(password + "\n")
    (tier,) = shared_tiers(TiersConfig(redis_url=url, redis_password_file=str(secret_file)))
    _round_trip(tier, 3)
    # through the config, as every kvblend process reads it at start-up
    from cluster.config import load_config, log_config, redacted

    monkeypatch.setenv("KVBLEND_REDIS_URL", url)
    monkeypatch.setenv("KVBLEND_REDIS_PASSWORD", password)
    cfg = load_config()
    (tier,) = shared_tiers(cfg.tiers)
    _round_trip(tier, 4)
    log_config(cfg)
    _assert_hidden(repr(cfg) + repr(cfg.tiers) + str(redacted(cfg)) + str(dict(cfg.sources)), password)
    monkeypatch.delenv("KVBLEND_REDIS_PASSWORD")
    monkeypatch.setenv("KVBLEND_REDIS_PASSWORD_FILE", str(secret_file))
    (tier,) = shared_tiers(load_config().tiers)
    _round_trip(tier, 5)
    # a wrong one is a counted miss, not a crash, and shows nothing either
    wrong = RedisTier.from_config(TiersConfig(redis_url=url, redis_password=password + "-wrong"))
    assert not wrong.put(make_key(6), b"x") and wrong.stats()["errors"] == 1
    _assert_hidden(caplog.text, password)


@pytest.mark.parametrize("password", ["S3cr3t/x", "S3cr3t#x", "S3cr3t?x", "S3cr3t%zz"])
def test_an_unencoded_password_in_the_url_is_refused_without_showing_a_part(password, caplog):
    url = f"redis://:{password}@127.0.0.1:6379/0"
    with pytest.raises(ValueError, match="not percent-encoded") as err:
        RedisTier(url)
    _assert_hidden(str(err.value), password)
    caplog.set_level(logging.DEBUG)
    assert shared_tiers(TiersConfig(redis_url=url)) == []  # the shards' set-up: a warning, no tier
    assert "redis tier" in caplog.text and "percent-encode" in caplog.text
    _assert_hidden(caplog.text, password)


def test_a_password_given_twice_or_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="give it once") as err:
        RedisTier("redis://:S3cr3t@127.0.0.1:6379/0", password="Other1pw")
    _assert_hidden(str(err.value), "S3cr3t")
    _assert_hidden(str(err.value), "Other1pw")
    with pytest.raises(ValueError, match="give one"):
        RedisTier.from_config(TiersConfig(redis_url="redis://127.0.0.1:6379/0", redis_password="a",
                                          redis_password_file=str(tmp_path / "f")))
    with pytest.raises(ValueError, match="cannot be read"):
        RedisTier.from_config(TiersConfig(redis_url="redis://127.0.0.1:6379/0",
                                          redis_password_file=str(tmp_path / "missing")))


def test_kvblend_clear_shared_with_a_password_file_keeps_it_out_of_argv_and_output(guarded, tmp_path):
    """End to end through a kvblend command: ``clear --shared`` reaches the guarded Redis with
    the password from ``$KVBLEND_REDIS_PASSWORD_FILE`` (argv holds no password) and deletes the
    chunk stored there; ``config show`` masks ``$KVBLEND_REDIS_PASSWORD``."""
    password = PASSWORDS[-1]
    url = guarded(password)
    secret_file = tmp_path / "redis-password"
    secret_file.write_text(password + "\n")
    tier = RedisTier(url, password=password)
    key = make_key(7)
    assert tier.put(key, make_object(key, make_kv(7))) and tier.contains([key]) == [True]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVBLEND_", "LMCACHE_"))}
    env.update(KVBLEND_REDIS_URL=url, KVBLEND_REDIS_PASSWORD_FILE=str(secret_file),
               KVBLEND_DISK_PATH=str(tmp_path / "disk"), KVBLEND_RAY_ADDRESS=f"127.0.0.1:{_closed_port()}")
    argv = [sys.executable, "-m", "cluster.cli.main", "clear", "--shared"]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    _assert_hidden(" ".join(argv) + done.stdout + done.stderr, password)
    assert tier.contains([key]) == [False], done.stdout + done.stderr
    env.pop("KVBLEND_REDIS_PASSWORD_FILE")
    env["KVBLEND_REDIS_PASSWORD"] = password
    shown = subprocess.run([sys.executable, "-m", "cluster.cli.main", "config", "show"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "redis_password" in shown.stdout, shown.stderr[-2000:]
    _assert_hidden(shown.stdout + shown.stderr, password)


def _closed_port() -> int:
    from cluster.workloads.services import free_port

    return free_port()
