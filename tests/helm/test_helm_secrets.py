"""Secrets stay out of command lines (issue 19): no container's command or args carries a
password, a Secret's value or a reference to a variable holding one (Kubernetes expands
``$(VAR)`` in args and the shell expands ``$VAR``: ``ps`` and the pod spec would show the result).
The internal Redis gets its password from a config file mounted from its Secret."""

from __future__ import annotations

import pytest
import re

from tests.helm._helm_chart import RELEASE

pytestmark = pytest.mark.integration


def _command_line(container: dict) -> str:
    return " ".join(str(x) for x in container.get("command", []) + container.get("args", []))


def _secret_env_names(container: dict) -> set[str]:
    """Variables of ``container`` that hold a secret: from a ``secretKeyRef``, or composed
    from one (a ``$(NAME)`` of one in its value)."""
    env = container.get("env", [])
    names = {e["name"] for e in env if "secretKeyRef" in e.get("valueFrom", {})}
    for e in env:
        if any(f"$({n})" in str(e.get("value", "")) for n in names):
            names.add(e["name"])
    return names


def test_no_container_command_line_carries_a_password(rendered):
    secret_values = [v for data in rendered.secrets.values() for v in data.values() if len(v) >= 8]
    cluster = rendered.one("RayCluster")["spec"]
    # KubeRay turns rayStartParams into the `ray start` command line of each Ray pod
    ray_start_params = str([g.get("rayStartParams", {})
                            for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]])
    for where, container, _ in rendered.containers():
        line = _command_line(container)
        assert "requirepass" not in line, f"{where}: a Redis password flag on the command line: {line}"
        assert "--redis-url" not in line, f"{where}: a Redis URL on the command line"
        for value in secret_values:
            assert value not in line, f"{where}: a Secret's value on the command line"
        for name in _secret_env_names(container) | {"KVBLEND_REDIS_PASSWORD", "KVBLEND_REDIS_URL"}:
            ref = re.compile(r"\$(\(|\{)?" + re.escape(name) + r"\b")
            assert not ref.search(line), f"{where}: the command line expands ${name}"
    for value in secret_values:
        assert value not in ray_start_params, "a Secret's value in rayStartParams"
    assert not re.search(r"REDIS_PASSWORD|KVBLEND_REDIS_URL|requirepass", ray_start_params)


def test_internal_redis_reads_its_password_from_a_mounted_config_file(rendered):
    if rendered.values["redis"]["mode"] != "internal":
        assert not rendered.of_kind("StatefulSet")
        return
    sts = rendered.one("StatefulSet", "redis")
    spec = sts["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    secret_name = f"{RELEASE}-kvblend-redis"
    data = rendered.secrets[secret_name]
    assert data["redis.conf"] == f'requirepass "{data["password"]}"\n'
    assert container["command"] == ["redis-server"]
    conf = container["args"][0]
    assert conf.endswith("/redis.conf") and "requirepass" not in _command_line(container)
    mount = next(m for m in container["volumeMounts"] if conf.startswith(m["mountPath"] + "/"))
    assert mount.get("readOnly") is True
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == secret_name
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]} == {"redis.conf": conf.rsplit("/", 1)[1]}
    # readable by the redis user (fsGroup) only; the password is in no environment variable
    assert volume["secret"]["defaultMode"] & 0o007 == 0
    assert "REDIS_PASSWORD" not in {e["name"] for e in container.get("env", [])}
    # the rest of the settings are unchanged and plain
    line = _command_line(container)
    assert "--maxmemory-policy allkeys-lru" in line and "--appendonly no" in line
    mib = int(rendered.values["redis"]["internal"]["maxmemoryGiB"] * 1024)
    assert f"--maxmemory {mib}mb" in line


def test_kvblend_pods_get_the_redis_password_whole_through_env_only(rendered):
    """#37: the password reaches kvblend whole (``KVBLEND_REDIS_PASSWORD``, redis-py's password
    option), never composed into a URL, where ``/``, ``#`` or ``?`` broke it."""
    for where, container, _ in rendered.containers():
        env = {e["name"]: e for e in container.get("env", [])}
        assert "KVBLEND_REDIS_URL" not in env, where
        if "KVBLEND_REDIS_PASSWORD" not in env:
            continue
        assert "secretKeyRef" in env["KVBLEND_REDIS_PASSWORD"]["valueFrom"], where
        assert "KVBLEND_REDIS_PASSWORD" not in _command_line(container), where
