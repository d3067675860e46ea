"""The object key at start-up (cluster.env.configure_object_auth, issue #19 item 5): from
``$KVBLEND_OBJECT_KEY`` or the file ``$KVBLEND_OBJECT_KEY_FILE`` names, set by ``load_config``
of the process environment; a short or unreadable key stops start-up without showing it."""

from __future__ import annotations

import pytest

from tests.factories import OBJECT_KEY_A, OBJECT_KEY_B, make_key, make_kv, make_object, object_keys
from tiers import auth
from tiers.format import parse_header

pytestmark = pytest.mark.unit

KEY_A, KEY_B = OBJECT_KEY_A, OBJECT_KEY_B


@pytest.fixture
def use_key():
    """``use_key(k)``: this process signs and checks under ``k`` (None: no key) until the test ends."""
    with object_keys() as use:
        yield use


def test_the_key_comes_from_the_environment_or_a_file_is_checked_and_never_shown(use_key, tmp_path):
    from cluster.env import configure_object_auth

    use_key(None)
    path = tmp_path / "object-key"
    path.write_text(KEY_A + "\n")
    # the file wins over the variable
    assert configure_object_auth({"KVBLEND_OBJECT_KEY_FILE": str(path), "KVBLEND_OBJECT_KEY": KEY_B})
    key, kv = make_key(6), make_kv(6)
    obj = make_object(key, kv)
    assert KEY_A not in repr(auth.current()) and KEY_A.encode() not in obj
    assert configure_object_auth({"KVBLEND_OBJECT_KEY": KEY_A})  # the file's newline was not part of the key
    assert parse_header(obj, expected_key=key).key == str(key)
    with pytest.raises(ValueError, match="at least 16") as err:
        configure_object_auth({"KVBLEND_OBJECT_KEY": "short"})
    assert "short" not in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        configure_object_auth({"KVBLEND_OBJECT_KEY_FILE": str(tmp_path / "missing")})
    assert not configure_object_auth({}) and auth.current() is None


def test_load_config_sets_the_key_and_refuses_a_bad_one(use_key, monkeypatch):
    """Every kvblend process loads its config from its environment at start-up (the vLLM
    connector, the CLI): that is where the key is taken, and a bad one stops start-up."""
    from cluster.config import load_config

    monkeypatch.setenv("KVBLEND_OBJECT_KEY", KEY_A)
    load_config()
    assert auth.current() is not None
    monkeypatch.setenv("KVBLEND_OBJECT_KEY", "short")
    with pytest.raises(ValueError, match="at least 16"):
        load_config()
