"""Secrets stay secret (issue 19): the effective config as logged and as ``kvblend config
show`` prints it masks the password of ``redis_url`` (and of any ``*_url``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from cluster.config import load_config

pytestmark = pytest.mark.cluster

PW = "hunter2pw"
URL = f"redis://:{PW}@redis:6379/0"
MASKED = "redis://:***@redis:6379/0"


def _kvblend(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("KVBLEND_", "LMCACHE_"))}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "cluster.cli.main", *args], capture_output=True, text=True, env=e)


def test_redacted_masks_the_password_and_keeps_the_rest():
    from cluster.config import redacted

    cfg = load_config(environ={"KVBLEND_REDIS_URL": URL}, overrides={"s3_endpoint_url": f"http://k:{PW}@m:9000"})
    shown = redacted(cfg)
    assert shown["redis_url"] == MASKED and shown["s3_endpoint_url"] == "http://k:***@m:9000"
    assert PW not in repr(shown) and PW not in repr(cfg)
    assert {k: v for k, v in shown.items() if not k.endswith("_url")} == \
        {k: v for k, v in cfg.as_flat_dict().items() if not k.endswith("_url")}
    assert cfg.tiers.redis_url == URL  # what the tiers get is unchanged


def test_logged_config_masks_the_password(caplog):
    from cluster.config import log_config

    cfg = load_config(environ={"KVBLEND_REDIS_URL": URL})
    with caplog.at_level(logging.INFO, logger="kvblend.config"):
        log_config(cfg)
    assert MASKED in caplog.text and PW not in caplog.text


def test_config_show_json_masks_the_password_and_exits_0():
    r = _kvblend("config", "show", "--json", env={"KVBLEND_REDIS_URL": URL})
    assert r.returncode == 0, r.stderr
    assert PW not in r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert data["redis_url"] == {"value": MASKED, "source": "env KVBLEND_REDIS_URL"}


def test_config_show_table_masks_the_password_and_exits_0(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(f"redis_url: 'redis://user:{PW}@r:1/0'\n")
    r = _kvblend("config", "show", "--config", str(f))
    assert r.returncode == 0, r.stderr
    flat = "".join(r.stdout.split())  # a folded cell cannot hide the password from this check
    assert PW not in r.stdout + r.stderr and PW not in flat.replace("│", "")
    assert "redis://user:***@r:1/0" in r.stdout
