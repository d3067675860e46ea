"""``kvblend server`` keeps a Redis password secret (issue 19): its logged config masks it,
``--redis-url-file`` and ``$KVBLEND_REDIS_URL`` keep it out of argv, and ``--help`` says that
``--redis-url`` exposes it. ``run`` is stopped where it first reaches for Ray (no cluster)."""

from __future__ import annotations

import argparse
import logging

import pytest

from cluster.cli import server

pytestmark = pytest.mark.cluster

PW = "hunter2pw"
URL = f"redis://:{PW}@redis:6379/0"
MASKED = "redis://:***@redis:6379/0"


class _Stop(Exception):
    """Raised instead of connecting to Ray."""


@pytest.fixture
def key_file(tmp_path):
    """A private object key file's place (not created), and this process's key restored after."""
    from tests.factories import object_keys

    with object_keys():
        yield tmp_path / "kvblend" / "object_key"


@pytest.fixture
def started(monkeypatch, caplog, key_file):
    """Run ``kvblend server ARGS`` up to its Ray connection; returns (logged text, config). The
    object key goes to ``key_file`` (``$KVBLEND_OBJECT_KEY_FILE``)."""
    import cluster.cache.connect

    for var in ("KVBLEND_CONFIG", "LMCACHE_CONFIG_FILE", "KVBLEND_REDIS_URL", "KVBLEND_OBJECT_KEY",
                "KVBLEND_OBJECT_AUTH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVBLEND_OBJECT_KEY_FILE", str(key_file))
    seen = {}

    def fake_connect(cluster_config, **_):
        seen["ray_address"] = cluster_config.ray_address
        raise _Stop

    monkeypatch.setattr(cluster.cache.connect, "connect", fake_connect)
    monkeypatch.setattr("cluster.cache.lifecycle.start_shards",
                        lambda cfg, *a, **k: pytest.fail("start_shards reached"))
    import cluster.config

    loaded, real_load = [], cluster.config.load_config

    def recording_load(*a, **k):
        loaded.append(real_load(*a, **k))
        return loaded[-1]

    monkeypatch.setattr(cluster.config, "load_config", recording_load)

    def run(*argv: str):
        p = argparse.ArgumentParser()
        server.add_arguments(p)
        args = p.parse_args(["--host-size-gib", "0.01", *argv])
        caplog.clear()
        with caplog.at_level(logging.INFO), pytest.raises(_Stop):
            server.run(args)
        assert seen, "run() never reached its Ray connection"
        return caplog.text, loaded[-1]

    return run


def test_server_log_masks_the_password_given_by_flag(started):
    text, cfg = started("--redis-url", URL)
    assert cfg.tiers.redis_url == URL  # the shards get the real URL
    assert "kvblend config" in text and MASKED in text
    assert PW not in text


def test_server_reads_the_url_from_a_file(started, tmp_path):
    f = tmp_path / "redis-url"
    f.write_text(f"# mounted from a Secret\n{URL}\n")
    text, cfg = started("--redis-url-file", str(f))
    assert cfg.tiers.redis_url == URL and cfg.sources["redis_url"] == "cli"
    assert MASKED in text and PW not in text


def test_server_reads_the_url_from_the_environment(started, monkeypatch):
    monkeypatch.setenv("KVBLEND_REDIS_URL", URL)
    text, cfg = started()
    assert cfg.tiers.redis_url == URL and cfg.sources["redis_url"] == "env KVBLEND_REDIS_URL"
    assert MASKED in text and PW not in text


def test_redis_url_file_errors_never_quote_the_file(tmp_path):
    f = tmp_path / "two"
    f.write_text(f"{URL}\n{URL}\n")
    with pytest.raises(ValueError, match="one URL") as err:
        server.read_url_file(str(f))
    assert PW not in str(err.value)
    with pytest.raises(ValueError, match="cannot be read"):
        server.read_url_file(str(tmp_path / "missing"))


def test_help_warns_that_redis_url_shows_in_ps(capsys):
    p = argparse.ArgumentParser()
    server.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--redis-url-file" in out and "KVBLEND_REDIS_URL" in out and "`ps`" in out
    with pytest.raises(SystemExit):
        p.parse_args(["--redis-url", URL, "--redis-url-file", "/x"])  # one or the other


def test_server_creates_the_object_key_on_a_fresh_machine(started, key_file, capsys):
    """Issue 37: a machine without an object key gets one before Ray starts (mode 0600, where
    ``$KVBLEND_OBJECT_KEY_FILE`` says); the server says where, never what, and signs from then
    on; a second start finds the same key."""
    import stat

    from tiers import auth

    assert not key_file.exists()
    text, _ = started()
    said = capsys.readouterr().err
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key) >= 32
    assert str(key_file) in said and "object authentication is on" in said
    assert key not in said + text
    assert auth.current() is not None
    started()
    assert key_file.read_text().strip() == key


def test_no_object_auth_creates_nothing_and_says_what_it_gives_up(started, key_file):
    from tiers import auth

    text, _ = started("--no-object-auth")
    assert not key_file.exists() and auth.current() is None
    assert "neither signed nor checked" in text and "plant" in text
