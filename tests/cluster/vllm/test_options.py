"""cluster.vllm.options: per-request kv_transfer_params are read without letting user input
grow the connector's state (issue #20: each unknown key added a warning kind forever)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from cluster.vllm.events import WarnOnce
from cluster.vllm.options import request_params

pytestmark = pytest.mark.unit


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


def test_restricted_keys_are_ignored_and_reported_while_overrides_are_off(caplog):
    """Issue 19: without ``allow_request_overrides`` a request's recompute ratio, store, load
    and blend switches are dropped (and listed for counting, warned about once); selection and
    async load stay the user's."""
    from cluster.vllm.options import RESTRICTED_PARAMS

    request = SimpleNamespace(kv_transfer_params={
        "kvblend_recompute_ratio": 0.0, "kvblend_store": False, "kvblend_load": False, "kvblend_blend": False,
        "kvblend_selection": "k_deviation", "kvblend_load_async": False})
    warn = WarnOnce()
    with caplog.at_level(logging.WARNING, logger="kvblend.connector"):
        for _ in range(3):
            ignored: list[str] = []
            got = request_params(request, warn, allow_overrides=False, ignored=ignored)
            assert got == {"kvblend_selection": "k_deviation", "kvblend_load_async": False}
            assert sorted(ignored) == sorted(RESTRICTED_PARAMS)
    assert sum("allow_request_overrides" in r.getMessage() for r in caplog.records) == 1
    assert request_params(request, warn) == request.kv_transfer_params  # allowed: all of them


def test_allow_request_overrides_must_be_a_bool():
    import pytest

    from cluster.vllm.options import ConnectorOptions

    assert ConnectorOptions.pop_from({}).allow_request_overrides is True
    assert ConnectorOptions.pop_from({"allow_request_overrides": False}).allow_request_overrides is False
    with pytest.raises(ValueError, match="allow_request_overrides"):
        ConnectorOptions.pop_from({"allow_request_overrides": "no"})
