"""cluster.vllm.options: per-request kv_transfer_params are read without letting user input
grow the connector's state (issue #20: each unknown key added a warning kind forever)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from cluster.vllm.events import WarnOnce
from cluster.vllm.options import request_params


def test_unknown_kvblend_keys_warn_once_and_hold_no_state_per_key(caplog):
    warn = WarnOnce()
    with caplog.at_level(logging.WARNING, logger="kvblend.connector"):
        for i in range(1000):
            got = request_params(SimpleNamespace(kv_transfer_params={
                f"kvblend_typo_{i}": 1, "kvblend_recompute_ratio": 0.5, "other_connector": 2}), warn)
            assert got == {"kvblend_recompute_ratio": 0.5}
    assert sum("unknown kv_transfer_params key" in r.getMessage() for r in caplog.records) == 1
    assert len(warn._warned) == 1


def test_no_params_is_empty():
    assert request_params(SimpleNamespace(kv_transfer_params=None), WarnOnce()) == {}
    assert request_params(SimpleNamespace(), WarnOnce()) == {}
