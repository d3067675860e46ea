"""The object key at start-up (cluster.env.configure_object_auth, issue #19 item 5): from
``$KVBLEND_OBJECT_KEY`` or the file ``$KVBLEND_OBJECT_KEY_FILE`` names, set by ``load_config``
of the process environment; a short or unreadable key stops start-up without showing it."""

from __future__ import annotations

import pytest

from tests.factories import OBJECT_KEY_A, OBJECT_KEY_B, make_key, make_kv, make_object, object_keys
from tiers import auth
from tiers.format import AuthError, parse_header

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


def test_the_default_key_file_is_found_by_every_process_of_the_machine(use_key, tmp_path):
    """Issue 37: ``~/.kvblend/object_key`` (where ``kvblend server`` creates it) is found with
    neither variable set, as Ray finds ``~/.ray/auth_token``; the variables still win."""
    from cluster.env import configure_object_auth, object_key_file

    home = tmp_path / "home"
    machine = {"HOME": str(home)}
    assert object_key_file(machine) == str(home / ".kvblend" / "object_key")
    use_key(None)
    assert not configure_object_auth(machine)  # nothing there yet: keyless
    (home / ".kvblend").mkdir(parents=True)
    (home / ".kvblend" / "object_key").write_text(KEY_A + "\n")
    assert configure_object_auth(machine)
    key, kv = make_key(7), make_kv(7)
    signed = make_object(key, kv)
    use_key(KEY_A)
    assert parse_header(signed, expected_key=key).key == str(key)  # the file's key, newline dropped
    assert configure_object_auth({**machine, "KVBLEND_OBJECT_KEY": KEY_B})  # the variable wins
    with pytest.raises(AuthError):
        parse_header(signed, expected_key=key)


def test_a_keyless_shard_of_a_keyed_cluster_refuses_to_start_saying_where(use_key, tmp_path):
    """Issue 37: ``kvblend server`` tells its shards a key is required; one that finds none
    refuses with where it looked (and how to turn authentication off); ``off`` runs keyless even
    when a key is found."""
    from cluster.env import configure_object_auth

    use_key(None)
    where = tmp_path / "keys" / "object-key"
    with pytest.raises(ValueError, match="no object key") as err:
        configure_object_auth({"HOME": str(tmp_path), "KVBLEND_OBJECT_AUTH": "required"})
    assert str(tmp_path / ".kvblend" / "object_key") in str(err.value) and "--no-object-auth" in str(err.value)
    with pytest.raises(ValueError, match="cannot read"):
        configure_object_auth({"KVBLEND_OBJECT_KEY_FILE": str(where), "KVBLEND_OBJECT_AUTH": "required"})
    assert configure_object_auth({"KVBLEND_OBJECT_KEY": KEY_A, "KVBLEND_OBJECT_AUTH": "required"})
    assert not configure_object_auth({"KVBLEND_OBJECT_KEY": KEY_A, "KVBLEND_OBJECT_AUTH": "off"})
    assert auth.current() is None


def test_the_cluster_mark_refuses_a_keyless_driver(use_key, monkeypatch):
    """Issue 37: a Ray driver without a key that joins a cluster whose ``kvblend server`` signs
    its chunk objects is disconnected with a message naming where the key is expected."""
    import types

    from cluster.cache import connect as connect_mod

    marks: dict[str, bytes] = {}  # Ray's internal key-value store, as the server wrote it
    monkeypatch.setattr(connect_mod, "_read_mark", marks.get)
    shut = []
    fake_ray = types.SimpleNamespace(shutdown=lambda: shut.append(1))
    use_key(None)
    connect_mod._check_object_key(fake_ray, "ns")  # no mark: an older or keyless deployment
    marks["ns"] = b"required"
    with pytest.raises(connect_mod.ObjectKeyMissing, match="no object key") as err:
        connect_mod._check_object_key(fake_ray, "ns")
    assert "'ns' signs its chunk objects" in str(err.value) and shut == [1]
    use_key(KEY_A)
    connect_mod._check_object_key(fake_ray, "ns")  # a keyed driver joins
    use_key(None)
    monkeypatch.setenv("KVBLEND_OBJECT_AUTH", "off")
    connect_mod._check_object_key(fake_ray, "ns")  # told to run keyless (--no-object-auth)
    assert shut == [1]


def test_a_vllm_process_whose_cache_agent_finds_no_key_refuses_to_start(monkeypatch):
    """Issue 37, the connector's default ``ray_client: agent``: the agent (the Ray driver) is
    refused by the cluster's mark, and the vLLM process's client raises it instead of serving
    without the shared cache."""
    from cluster.cache.agent_transport import AgentTransport
    from cluster.cache.connect import ObjectKeyMissing
    from cluster.cache.factory import agent_client
    from cluster.cache.local import LocalCacheClient
    from cluster.config import load_config

    refused = "no object key: the kvblend cluster in Ray namespace 'ns' signs its chunk objects; ..."
    monkeypatch.setattr(AgentTransport, "_address", lambda self: "127.0.0.1:1")
    monkeypatch.setattr(AgentTransport, "_spawn", lambda self, timeout_s, shards_wait_s=0.0: (None, f"ObjectKeyMissing: {refused}"))
    config = load_config(environ={})
    with pytest.raises(ObjectKeyMissing, match="no object key"):
        agent_client(config, "ns", LocalCacheClient(), start_timeout_s=1.0)
    # any other failed start is the usual fallback
    monkeypatch.setattr(AgentTransport, "_spawn", lambda self, timeout_s, shards_wait_s=0.0: (None, "Ray is gone"))
    client = agent_client(config, "ns", LocalCacheClient(), start_timeout_s=1.0)
    assert not client.transports[0].up
    client.close()
