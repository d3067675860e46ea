"""The connector's start-up log masks a Redis password (issue 19). The connector is built
idle (``kv_cache_dtype`` it does not support: no cache client, no Ray) from a stand-in vLLM
config with just what its constructor reads."""

from __future__ import annotations

import json
import logging

import pytest

from tests.cluster.vllm.helpers import stand_in_vllm_config

pytestmark = pytest.mark.cluster

PW = "hunter2pw"
URL = f"redis://:{PW}@redis:6379/0"


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 2}))
    return tmp_path


@pytest.mark.parametrize("where", ["extra_config", "env"])
def test_connector_config_log_masks_the_password(where, model_dir, monkeypatch, caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from cluster.vllm.connector import KVBlendConnector

    for var in ("KVBLEND_CONFIG", "LMCACHE_CONFIG_FILE", "KVBLEND_REDIS_URL"):
        monkeypatch.delenv(var, raising=False)
    extra = {"redis_url": URL} if where == "extra_config" else {}
    if where == "env":
        monkeypatch.setenv("KVBLEND_REDIS_URL", URL)
    vllm_config = stand_in_vllm_config(model_dir, extra=extra, cache_dtype="fp8")
    with caplog.at_level(logging.INFO):
        connector = KVBlendConnector(vllm_config, KVConnectorRole.SCHEDULER)
    assert not connector.enabled and connector.config.tiers.redis_url == URL
    logged = [r.getMessage() for r in caplog.records if r.name == "kvblend.config"]
    assert any("redis://:***@redis:6379/0" in m for m in logged), logged
    assert PW not in caplog.text
