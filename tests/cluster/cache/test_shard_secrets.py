"""Shards get their secrets out of sight (issue 19): :func:`start_shards` puts nothing into a
Ray ``runtime_env`` (``ray list actors --detail`` and the dashboard show it); the Redis URL and
any ``env_vars`` travel as constructor arguments, which Ray does not show. Ray is replaced by
a recorder of what ``start_shards`` asks of it: no cluster."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from cluster.config import load_config
from tests.factories import stop_shard

pytestmark = pytest.mark.cluster

PW = "hunter2pw"
URL = f"redis://:{PW}@redis:6379/0"
CREDS = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY", "AWS_SECRET_ACCESS_KEY": "s3cr3t-aws-key"}


class _Recorder:
    """Stands in for ``ray.remote(CacheShard)``: records each ``options(...).remote(...)``."""

    def __init__(self):
        self.calls: list[dict] = []

    def options(self, **options):
        call = {"options": options}
        self.calls.append(call)

        def remote(*args, **kwargs):
            call["args"], call["kwargs"] = args, kwargs
            return SimpleNamespace(ready=SimpleNamespace(remote=lambda: "ready-ref"))

        return SimpleNamespace(remote=remote)


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    import ray

    rec = _Recorder()
    monkeypatch.setattr(ray, "remote", lambda cls: rec)
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "NodeID": "ab" * 28, "Resources": {"kvblend_shard": 1.0}},
        {"Alive": True, "NodeID": "cd" * 28, "Resources": {"kvblend_shard": 1.0}}])
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: True)
    # the node and actor listings ask Ray's state API, which would start a real Ray in this
    # process (ray.init on first use) and leave it connected for the modules after this one
    from cluster.cache import lifecycle

    monkeypatch.setattr(lifecycle, "node_names", lambda node_ids, timeout_s: {})
    monkeypatch.setattr(lifecycle, "shard_names", lambda namespace: [])
    return rec


def test_start_shards_puts_no_secret_into_runtime_env(recorded, tmp_path):
    from cluster.cache.lifecycle import start_shards

    cfg = load_config(environ={"KVBLEND_REDIS_URL": URL},
                      overrides={"disk_path": str(tmp_path), "shards_per_node": 2})
    names = start_shards(cfg, env_vars=CREDS)
    assert len(names) == 4 and len(recorded.calls) == 4
    secrets = [PW, *CREDS.values()]
    for call in recorded.calls:
        options = call["options"]
        assert not options.get("runtime_env"), options.get("runtime_env")
        assert not any(s in repr(options) for s in secrets), options
        # the data path is unchanged: the real URL and the credentials reach the shard
        name, tiers_config, _disk_root, _metrics, env = call["args"]
        assert tiers_config.redis_url == URL and env == CREDS
        assert PW not in repr(tiers_config)  # what Ray shows of an actor's failure, logs


def test_start_shards_without_env_vars_passes_an_empty_env(recorded, tmp_path):
    from cluster.cache.lifecycle import start_shards

    start_shards(load_config(environ={}, overrides={"disk_path": str(tmp_path)}))
    assert all(not c["options"].get("runtime_env") and c["args"][4] == {} for c in recorded.calls)


def test_shard_sets_its_env_before_opening_the_tiers(monkeypatch, tmp_path):
    """The constructor's ``env`` is in the shard process's environment by the time its
    shared tiers open (boto3 reads credentials from there)."""
    import ray

    from cluster.cache import shard as shard_mod
    from tiers.config import TiersConfig

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "ab" * 28))
    monkeypatch.setattr(shard_mod.CacheShard, "_publish_loop", lambda self: None)
    for k in CREDS:
        monkeypatch.setenv(k, "before")  # monkeypatch restores them after the test
    seen = {}

    def fake_shared_tiers(cfg):
        seen.update({k: os.environ.get(k) for k in CREDS}, url=cfg.redis_url)
        return []

    monkeypatch.setattr(shard_mod, "shared_tiers", fake_shared_tiers)
    cfg = TiersConfig(host_size_gib=0.001, disk_size_gib=0.0, redis_url=URL)
    s = shard_mod.CacheShard("kvblend-shard-test-0", cfg, str(tmp_path), metrics=False, env=CREDS)
    try:
        assert seen == {**CREDS, "url": URL}
        assert s.cfg == cfg
    finally:
        stop_shard(s)
