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
                f"kvblend_typo_{i}": 1, "kvblend_recompute_ratio": 0.5, "other_connector": 2}), warn, allow_overrides=True)
            assert got == {"kvblend_recompute_ratio": 0.5}
    assert sum("unknown kv_transfer_params key" in r.getMessage() for r in caplog.records) == 1
    assert len(warn._warned) == 1


def test_no_params_is_empty():
    assert request_params(SimpleNamespace(kv_transfer_params=None), WarnOnce()) == {}
    assert request_params(SimpleNamespace(), WarnOnce()) == {}


def test_every_request_key_is_ignored_and_reported_while_overrides_are_off(caplog):
    """Issues 19 and 37: without ``allow_request_overrides`` (the default) a request's recompute
    ratio, store, load and blend switches, its selection and its ``kvblend_load_async`` (a
    synchronous blend stalls every other request's engine step) are dropped, listed for
    counting and warned about once."""
    from cluster.vllm.options import REQUEST_PARAMS, RESTRICTED_PARAMS

    assert set(RESTRICTED_PARAMS) == set(REQUEST_PARAMS)
    request = SimpleNamespace(kv_transfer_params={
        "kvblend_recompute_ratio": 0.0, "kvblend_store": False, "kvblend_load": False, "kvblend_blend": False,
        "kvblend_selection": "k_deviation", "kvblend_load_async": False})
    warn = WarnOnce()
    with caplog.at_level(logging.WARNING, logger="kvblend.connector"):
        for _ in range(3):
            ignored: list[str] = []
            assert request_params(request, warn, allow_overrides=False, ignored=ignored) == {}
            assert sorted(ignored) == sorted(REQUEST_PARAMS)
    assert sum("allow_request_overrides" in r.getMessage() for r in caplog.records) == 1
    assert request_params(request, warn, allow_overrides=True) == request.kv_transfer_params  # allowed


def test_load_async_and_recompute_ratio_of_a_request_are_ignored_by_default():
    """Issue 37: an API request's ``kvblend_load_async: false`` and ``kvblend_recompute_ratio``
    are ignored unless the operator turned overrides on (the connector's default is off)."""
    from cluster.vllm.options import ConnectorOptions

    request = SimpleNamespace(kv_transfer_params={"kvblend_load_async": False, "kvblend_recompute_ratio": 0.0})
    assert request_params(request, WarnOnce()) == {}
    assert ConnectorOptions.pop_from({}).allow_request_overrides is False


def test_allow_request_overrides_must_be_a_bool():
    import pytest

    from cluster.vllm.options import ConnectorOptions

    assert ConnectorOptions.pop_from({"allow_request_overrides": True}).allow_request_overrides is True
    assert ConnectorOptions.pop_from({"allow_request_overrides": False}).allow_request_overrides is False
    with pytest.raises(ValueError, match="allow_request_overrides"):
        ConnectorOptions.pop_from({"allow_request_overrides": "no"})
