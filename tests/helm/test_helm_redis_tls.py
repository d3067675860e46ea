"""Redis over TLS with the chart's values shape (issue 19): ``redis.external.tls`` plus
``redis.external.tlsSecret`` mount the Secret's certificate files read-only into the vLLM and
shard pods and point ``KVBLEND_REDIS_TLS_*`` at them.

End to end, without a cluster: the chart is rendered by the real ``helm template`` against a
real TLS-only redis-server (``private_redis(tls=True, ...)``, a throwaway CA); what the
kubelet would do for a container is done here by :func:`_kubelet_view` (Secret and ConfigMap
volumes written out as files, ``secretKeyRef`` values filled in, ``$(VAR)`` expanded); the
product's own loader (:func:`cluster.config.load_config`) builds the config from that
environment and :func:`tiers.lower.shared_tiers` opens the Redis tier a shard or a client
would, through which a chunk makes the round trip.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from cluster.config import load_config
from tests.factories import make_key, make_kv, make_object
from tests.helm._helm_chart import Rendered
from tiers.lower import shared_tiers

pytestmark = pytest.mark.integration

TLS_SECRET = "redis-client-tls"
# a password no URL could carry unencoded (#37): the chart hands it to kvblend whole
PW_SECRET, PW_KEY, PW = "my-redis", "redis-password", "tls/e2e#re?dis%pw@ x"
TLS_DIR = "/etc/kvblend-redis-tls"
TLS_ENV = {"KVBLEND_REDIS_TLS_CA_FILE": "ca.crt", "KVBLEND_REDIS_TLS_CERT_FILE": "tls.crt",
           "KVBLEND_REDIS_TLS_KEY_FILE": "tls.key"}
# (where in Rendered.containers(), the pod) of the pods that talk to Redis
REDIS_PODS = {"vllm": "Deployment/kvb-kvblend-vllm/vllm",
              "shard": "RayCluster/kvb-kvblend/cache-shards/ray-worker"}


def _sets(host: str, port: int, *, secret: bool = True, client_cert: bool = True) -> tuple[str, ...]:
    sets = ["redis.mode=external", f"redis.external.host={host}", f"redis.external.port={port}",
            "redis.external.db=0", "redis.external.tls=true",
            f"redis.external.passwordSecret.name={PW_SECRET}",
            f"redis.external.passwordSecret.key={PW_KEY}"]
    if secret:
        sets += [f"redis.external.tlsSecret.name={TLS_SECRET}", "redis.external.tlsSecret.caKey=ca.crt"]
        if client_cert:
            sets += ["redis.external.tlsSecret.certKey=tls.crt", "redis.external.tlsSecret.keyKey=tls.key"]
    return tuple(sets)


def _container(rendered: Rendered, pod: str) -> tuple[dict, dict]:
    (found,) = [(c, spec) for where, c, spec in rendered.containers() if where == REDIS_PODS[pod]]
    return found


def _kubelet_view(rendered: Rendered, container: dict, spec: dict, secrets: dict[str, dict[str, str]],
                  root: Path) -> dict[str, str]:
    """The environment a process of ``container`` sees, with its Secret and ConfigMap volumes
    written under ``root`` as the kubelet projects them (``items`` key -> path, ``defaultMode``)
    and every variable naming a file in a mount rewritten to the file under ``root``.

    Args:
        secrets: the cluster's Secrets, ``{name: {key: value}}`` (the chart's own are added).
    """
    secrets = {**rendered.secrets, **secrets}
    configmaps = {cm["metadata"]["name"]: cm["data"] for cm in rendered.of_kind("ConfigMap")}
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts: dict[str, Path] = {}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if "secret" in vol:
            data, items, mode = secrets[vol["secret"]["secretName"]], vol["secret"].get("items"), vol["secret"].get("defaultMode", 0o644)
        elif "configMap" in vol:
            data, items, mode = configmaps[vol["configMap"]["name"]], vol["configMap"].get("items"), 0o644
        else:
            continue
        assert m.get("readOnly") is True, m
        local = root / m["mountPath"].lstrip("/")
        local.mkdir(parents=True)
        for item in items or [{"key": k, "path": k} for k in data]:
            path = local / item["path"]
            path.write_text(data[item["key"]])
            path.chmod(mode)
        mounts[m["mountPath"]] = local
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:  # Kubernetes expands $(VAR) of variables defined before
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            value = secrets[ref["name"]][ref["key"]]
        else:
            value = "pod-field"  # fieldRef: POD_IP, the node name
        for mount_path, local in mounts.items():
            if value.startswith(mount_path.rstrip("/") + "/"):
                value = str(local / value[len(mount_path.rstrip("/")) + 1:])
        env[e["name"]] = value
    return env


def test_tls_secret_is_mounted_into_the_vllm_and_shard_pods_and_named_by_env(helm):
    rendered = helm.render(None, *_sets("redis.cache.svc.cluster.local", 6380))
    for pod in REDIS_PODS:
        container, spec = _container(rendered, pod)
        env = {e["name"]: e for e in container["env"]}
        for var, name in TLS_ENV.items():
            assert env[var] == {"name": var, "value": f"{TLS_DIR}/{name}"}, (pod, var)
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == TLS_DIR]
        assert mount["readOnly"] is True
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        secret = volume["secret"]
        assert secret["secretName"] == TLS_SECRET
        assert {i["key"]: i["path"] for i in secret["items"]} == {
            "ca.crt": "ca.crt", "tls.crt": "tls.crt", "tls.key": "tls.key"}
        assert secret["defaultMode"] & 0o007 == 0  # the key readable by the pod's group only
        line = " ".join(container.get("command", []) + container.get("args", []))
        assert TLS_DIR not in line and TLS_SECRET not in line, pod
    # the ConfigMap holds the scheme and no file (the files are the mounting pods' own)
    cm = rendered.one("ConfigMap", "config")["data"]["kvblend.yaml"]
    assert "redis_url: rediss://redis.cache.svc.cluster.local:6380/0" in cm
    assert all(f"redis_tls_{p}_file: \"\"" in cm for p in ("ca", "cert", "key"))
    # every container that names a TLS file has the Secret mounted where the name points
    for where, container, _ in rendered.containers():
        names = {e["name"] for e in container.get("env", [])} & set(TLS_ENV)
        mounted = any(m["mountPath"] == TLS_DIR for m in container.get("volumeMounts", []))
        assert not names or mounted, where


def test_tls_without_a_secret_or_client_cert_mounts_only_what_is_named(helm):
    rendered = helm.render(None, *_sets("redis.example", 6379, client_cert=False))
    container, spec = _container(rendered, "vllm")
    env = {e["name"] for e in container["env"]}
    assert "KVBLEND_REDIS_TLS_CA_FILE" in env
    assert not env & {"KVBLEND_REDIS_TLS_CERT_FILE", "KVBLEND_REDIS_TLS_KEY_FILE"}
    (volume,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == TLS_SECRET]
    assert volume["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    rendered = helm.render(None, *_sets("redis.example", 6379, secret=False))
    for where, container, spec in rendered.containers():
        assert not {e["name"] for e in container.get("env", [])} & set(TLS_ENV), where
        assert not any(m["mountPath"] == TLS_DIR for m in container.get("volumeMounts", [])), where


@pytest.mark.parametrize(("sets", "message"), [
    (("redis.external.tls=false",), "tls is false"),
    (("redis.external.tlsSecret.certKey=", "redis.external.tlsSecret.keyKey=tls.key"), "keyKey is set without certKey"),
    (("redis.external.tlsSecret.caKey=", "redis.external.tlsSecret.certKey=", "redis.external.tlsSecret.keyKey="), "names no file"),
    (("redis.external.tlsSecret.caFile=ca.crt",), "caFile"),
], ids=["secret-without-tls", "key-without-cert", "no-file", "unknown-key"])
def test_tls_values_that_cannot_work_are_refused(helm, sets, message):
    proc = helm.template(None, *_sets("redis.example", 6379), *sets, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("pod", list(REDIS_PODS))
def test_chart_env_reaches_a_tls_redis_and_round_trips_a_chunk(helm, private_redis, tmp_path, pod):
    """The pod's rendered environment and mounts, with the Secret holding the throwaway CA and
    client certificate, open the Redis tier of a ``tls-auth-clients yes`` redis-server that
    also wants the password: a chunk goes in and comes back byte-identical."""
    server = private_redis("--requirepass", PW, tls=True, tls_auth_clients="yes")
    rendered = helm.render(None, *_sets("127.0.0.1", server.port))
    container, spec = _container(rendered, pod)
    tls = server.tls
    cluster_secrets = {
        TLS_SECRET: {"ca.crt": Path(tls.ca_file).read_text(), "tls.crt": Path(tls.client_cert_file).read_text(),
                     "tls.key": Path(tls.client_key_file).read_text()},
        PW_SECRET: {PW_KEY: PW}}
    env = _kubelet_view(rendered, container, spec, cluster_secrets, tmp_path / "pod")
    assert env["KVBLEND_REDIS_PASSWORD"] == PW and "KVBLEND_REDIS_URL" not in env  # whole, not in a URL

    cfg = load_config(environ=env)  # KVBLEND_CONFIG: the ConfigMap's file, then KVBLEND_* vars
    t = cfg.tiers
    assert cfg.sources["redis_tls_ca_file"] == "env KVBLEND_REDIS_TLS_CA_FILE"
    local = tmp_path / "pod" / TLS_DIR.lstrip("/")
    assert (t.redis_tls_ca_file, t.redis_tls_cert_file, t.redis_tls_key_file) == (
        str(local / "ca.crt"), str(local / "tls.crt"), str(local / "tls.key"))
    assert Path(t.redis_tls_key_file).read_text() == Path(tls.client_key_file).read_text()
    assert os.stat(t.redis_tls_key_file).st_mode & 0o777 == 0o440

    (tier,) = shared_tiers(t)
    try:
        key = make_key(7)
        obj = make_object(key, make_kv(7))
        assert tier.put(key, obj) is True
        assert tier.get(key) == bytes(obj)
        assert tier.stats()["errors"] == 0
    finally:
        tier.close()


def test_chart_env_without_the_tls_secret_gets_counted_misses(helm, private_redis, tmp_path):
    """Same server, the chart without tlsSecret (the image's system CAs): the tier opens and
    every call is a miss counted as an error, never an exception."""
    server = private_redis("--requirepass", PW, tls=True)
    rendered = helm.render(None, *_sets("127.0.0.1", server.port, secret=False))
    container, spec = _container(rendered, "vllm")
    env = _kubelet_view(rendered, container, spec, {PW_SECRET: {PW_KEY: PW}}, tmp_path / "pod")
    cfg = load_config(environ=env)
    assert cfg.tiers.redis_url.startswith("rediss://") and not cfg.tiers.redis_tls_ca_file
    (tier,) = shared_tiers(cfg.tiers)
    try:
        key = make_key(8)
        assert tier.put(key, make_object(key, make_kv(8))) is False
        assert tier.get(key) is None and tier.contains([key]) == [False]
        assert tier.stats()["errors"] == 3
    finally:
        tier.close()
