"""What pods need at run time and what they must not have: /dev/shm and the object store,
the Ray token, shard resources and sizes, hardened security, no secrets in plain sight."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from tests.helm._helm_chart import RELEASE

pytestmark = pytest.mark.integration

GIB = 2**30
MI = 2**20


def _quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", str(q))
    assert m, f"unexpected quantity {q!r}"
    return int(m.group(1)) * (MI if m.group(2) == "Mi" else GIB)


def _ray_pods(rendered) -> list[tuple[str, dict]]:
    """Pods that run a Ray node: head, shards, vLLM replicas, the test hook."""
    return [(w, t) for w, t in rendered.pod_templates() if "StatefulSet" not in w]


def _shm_bytes(spec: dict, container: dict) -> int:
    mount = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(mount) == 1
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount[0]["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    return _quantity_bytes(volume["emptyDir"]["sizeLimit"])


def test_object_store_is_explicit_and_fits_in_dev_shm(rendered):
    v = rendered.values
    cluster = rendered.one("RayCluster")
    sizes = [(cluster["spec"]["headGroupSpec"], v["head"]["objectStoreGiB"])] + [
        (group, v["kvblend"]["config"]["object_store_gib"]) for group in cluster["spec"]["workerGroupSpecs"]]
    for group, gib in sizes:
        object_store = int(gib * GIB)
        assert int(group["rayStartParams"]["object-store-memory"]) == object_store
        spec = group["template"]["spec"]
        assert _shm_bytes(spec, spec["containers"][0]) >= object_store
    vllm = rendered.one("Deployment", "vllm")["spec"]["template"]["spec"]
    container = vllm["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    object_store = int(v["vllm"]["objectStoreGiB"] * GIB)
    assert int(env["RAY_OBJECT_STORE_BYTES"]) == object_store
    assert '--object-store-memory="$RAY_OBJECT_STORE_BYTES"' in container["command"][2]
    shm_needed = object_store + v["vllm"]["shmSizeGiB"] * GIB
    assert _shm_bytes(vllm, container) >= shm_needed
    test_pod = rendered.one("Pod")
    assert _shm_bytes(test_pod["spec"], test_pod["spec"]["containers"][0]) >= 104857600


def test_ray_token_reaches_every_ray_process_from_a_secret(rendered):
    auth = rendered.values["rayAuth"]
    secret_name = auth["existingSecret"] or f"{RELEASE}-kvblend-ray-token"
    if not auth["existingSecret"]:
        assert secret_name in rendered.secrets
        assert len(rendered.secrets[secret_name][auth["secretKey"]]) >= 32
    else:
        assert secret_name not in rendered.secrets
    for where, tpl in _ray_pods(rendered):
        env = {e["name"]: e for e in tpl["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", where
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret_name, "key": auth["secretKey"]}, where
        assert "value" not in env["RAY_AUTH_TOKEN"], where


def test_ray_token_auth_can_be_turned_off(helm):
    rendered = helm.render(None, "rayAuth.enabled=false")
    assert not rendered.secrets.get(f"{RELEASE}-kvblend-ray-token")
    envs = [e["name"] for _, c, _ in rendered.containers() for e in c.get("env", [])]
    assert "RAY_AUTH_MODE" not in envs and "RAY_AUTH_TOKEN" not in envs


def test_object_key_reaches_every_kvblend_process_from_a_secret(rendered):
    """tiers.auth: vLLM pods, the Ray head and the shards sign and check chunk objects under
    one key the chart keeps in a Secret (by reference, never a literal value)."""
    auth = rendered.values["objectAuth"]
    secret_name = auth["existingSecret"] or f"{RELEASE}-kvblend-object-key"
    if not auth["existingSecret"]:
        assert len(rendered.secrets[secret_name][auth["secretKey"]]) >= 32
    for where, tpl in _ray_pods(rendered):
        env = {e["name"]: e for e in tpl["spec"]["containers"][0]["env"]}
        assert env["KVBLEND_OBJECT_KEY"] == {"name": "KVBLEND_OBJECT_KEY", "valueFrom": {
            "secretKeyRef": {"name": secret_name, "key": auth["secretKey"]}}}, where


def test_object_authentication_can_be_turned_off(helm):
    rendered = helm.render(None, "objectAuth.enabled=false")
    assert not rendered.secrets.get(f"{RELEASE}-kvblend-object-key")
    assert "KVBLEND_OBJECT_KEY" not in [e["name"] for _, c, _ in rendered.containers() for e in c.get("env", [])]
    # and `kvblend server` is told so: without it each shard pod would create a key of its own (#37)
    script = rendered.one("RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["args"][0]
    assert "kvblend server" in script and "--no-object-auth" in script


def test_kvblend_server_keeps_object_authentication_on_by_default(rendered):
    script = rendered.one("RayCluster")["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["args"][0]
    assert "kvblend server" in script and "--no-object-auth" not in script


def test_shard_workers_advertise_the_shard_resource(rendered):
    cfg = rendered.values["kvblend"]["config"]
    cluster = rendered.one("RayCluster")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    # KubeRay writes --resources=<value> into a shell command: unquote as bash would.
    (word,) = shlex.split("--resources=" + group["rayStartParams"]["resources"])
    assert json.loads(word.split("=", 1)[1]) == {cfg["shard_resource"]: cfg["shards_per_node"]}
    head_params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert "resources" not in head_params and head_params["num-cpus"] == "0"
    script = group["template"]["spec"]["containers"][0]["args"][0]
    assert '"$KUBERAY_GEN_RAY_START_CMD" &' in script
    assert 'kvblend server --address "$RAY_HEAD_ADDRESS" --disk-path "$SHARD_DISK_PATH"' in script


def test_shard_memory_and_disk_fit_the_configured_tiers(rendered):
    cfg = rendered.values["kvblend"]["config"]
    group = rendered.one("RayCluster")["spec"]["workerGroupSpecs"][0]
    spec = group["template"]["spec"]
    container = spec["containers"][0]
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits["memory"] == requests["memory"]  # Guaranteed memory: no eviction under pressure
    # The host tier of the node's shards lives in the Ray object store (cluster/cli/server.py),
    # which lives in the memory-backed /dev/shm, which counts against the memory limit.
    host = cfg["host_size_gib"] * cfg["shards_per_node"] * GIB
    object_store = int(group["rayStartParams"]["object-store-memory"])
    assert host <= object_store <= _shm_bytes(spec, container)
    overhead = rendered.values["shards"]["memoryOverheadGiB"] * GIB
    assert _quantity_bytes(limits["memory"]) >= _shm_bytes(spec, container) + overhead
    disk_mount = [m for m in container["volumeMounts"] if m["mountPath"] == cfg["disk_path"]]
    assert len(disk_mount) == 1
    (volume,) = [v for v in spec["volumes"] if v["name"] == disk_mount[0]["name"]]
    disk_needed = cfg["disk_size_gib"] * cfg["shards_per_node"] * GIB
    kind = rendered.values["shards"]["disk"]["type"]
    if kind == "emptyDir":
        assert _quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= disk_needed
    elif kind == "pvc":
        claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert _quantity_bytes(claim["resources"]["requests"]["storage"]) >= disk_needed
        assert claim["storageClassName"] == rendered.values["shards"]["disk"]["storageClassName"]
    else:
        assert volume["hostPath"]["path"] == rendered.values["shards"]["disk"]["hostPath"]


def test_host_tier_larger_than_the_object_store_is_refused(helm):
    proc = helm.template(None, "kvblend.config.host_size_gib=12", "kvblend.config.shards_per_node=2",
                         check=False)
    assert proc.returncode != 0
    assert "host_size_gib (12) x shards_per_node (2) = 24 GiB exceeds object_store_gib (20)" in proc.stderr
    assert helm.template(None, "kvblend.config.host_size_gib=10",
                         "kvblend.config.shards_per_node=2").returncode == 0


def test_containers_are_hardened(rendered):
    for where, tpl in rendered.pod_templates():
        pod_sc = tpl["spec"]["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, where
        assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert tpl["spec"]["automountServiceAccountToken"] is False, where
        assert not tpl["spec"].get("hostNetwork") and not tpl["spec"].get("hostPID"), where
    for where, container, _ in rendered.containers():
        sc = container["securityContext"]
        assert sc["privileged"] is False, where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where


def _plain_strings(rendered):
    """(where, text) for every env value and ConfigMap entry: places secrets must not be."""
    for where, container, _ in rendered.containers():
        for e in container.get("env", []):
            if "value" in e:
                yield f"{where} env {e['name']}", str(e["value"])
        yield f"{where} args", " ".join(container.get("command", []) + container.get("args", []))
    for cm in rendered.of_kind("ConfigMap"):
        for key, text in cm.get("data", {}).items():
            yield f"ConfigMap/{cm['metadata']['name']}/{key}", text


def test_no_secret_values_in_plain_env_or_configmaps(rendered):
    secret_values = [v for data in rendered.secrets.values() for v in data.values() if len(v) >= 8]
    for where, text in _plain_strings(rendered):
        for value in secret_values:
            assert value not in text, f"a Secret's value appears in {where}"
    sensitive = re.compile(r"PASSWORD|TOKEN|SECRET|ACCESS_KEY", re.I)
    for where, container, _ in rendered.containers():
        for e in container.get("env", []):
            if sensitive.search(e["name"]):
                assert "secretKeyRef" in e.get("valueFrom", {}), f"{where}: {e['name']} not from a Secret"
            # the password comes whole (KVBLEND_REDIS_PASSWORD), never inside a URL (#37: a
            # password with '/', '#' or '?' broke a URL built from it)
            assert e["name"] != "KVBLEND_REDIS_URL" and "$(" not in str(e.get("value", "")), where


def test_redis_password_path(rendered):
    redis = rendered.values["redis"]
    kvblend = [(w, c) for w, c, _ in rendered.containers() if "KVBLEND_CONFIG" in
               {e["name"] for e in c.get("env", [])}]
    assert kvblend
    for where, container in kvblend:
        env = {e["name"]: e for e in container["env"]}
        if redis["mode"] == "external" and redis["external"]["passwordSecret"]["name"]:
            ref = env["KVBLEND_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref == redis["external"]["passwordSecret"], where
        elif redis["mode"] == "internal":
            ref = env["KVBLEND_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] in rendered.secrets, where
        else:
            assert "KVBLEND_REDIS_PASSWORD" not in env and "KVBLEND_REDIS_URL" not in env, where
    if redis["mode"] == "internal":
        sts = rendered.one("StatefulSet", "redis")
        container = sts["spec"]["template"]["spec"]["containers"][0]
        # The password is in the Secret's redis.conf, the first argument; never a --requirepass
        # flag (tests/helm/test_helm_secrets.py checks the rest).
        assert container["args"][0] == "/etc/redis/redis.conf"


def test_s3_credentials_come_from_a_secret_or_the_service_account(rendered):
    s3 = rendered.values["s3"]
    sa = rendered.of_kind("ServiceAccount")
    for where, container, _ in rendered.containers():
        env = {e["name"]: e for e in container.get("env", [])}
        if s3["enabled"] and s3["credentialsSecret"]["name"] and "KVBLEND_CONFIG" in env:
            ref = env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == s3["credentialsSecret"]["name"], where
        else:
            assert "AWS_SECRET_ACCESS_KEY" not in env, where
    annotations = rendered.values["serviceAccount"]["annotations"]
    if annotations:
        assert sa and sa[0]["metadata"]["annotations"] == annotations


@pytest.mark.parametrize("sets", [("containerSecurityContext.capabilities.add={NET_ADMIN}",)],
                         ids=["add-capability"])
def test_schema_refuses_weakened_security(helm, sets):
    assert helm.template(None, *sets, check=False).returncode != 0


@pytest.mark.parametrize("disk_type", ["emptyDir", "pvc", "hostPath"])
def test_shard_pods_name_their_node_after_what_outlives_their_disk(helm, disk_type):
    """hostPath outlives pods on a machine: the Kubernetes node's name; emptyDir and ephemeral
    PVCs live as long as the pod: the pod's name (cluster/cache/identity.py)."""
    group = helm.render(None, f"shards.disk.type={disk_type}").one("RayCluster")["spec"]["workerGroupSpecs"][0]
    env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
    want = "spec.nodeName" if disk_type == "hostPath" else "metadata.name"
    assert env["KVBLEND_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": want}}


@pytest.mark.parametrize("fallback", ["off", "memory", "disk"])
def test_vllm_local_fallback_is_the_pods_own_and_disk_gets_a_bounded_volume(helm, fallback):
    rendered = helm.render(None, f"vllm.localFallback={fallback}")
    spec = rendered.one("Deployment", "vllm")["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVBLEND_LOCAL_FALLBACK"] == fallback
    cfg = rendered.values["kvblend"]["config"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    if fallback != "disk":
        assert cfg["disk_path"] not in mounts
        return
    (volume,) = [v for v in spec["volumes"] if v["name"] == mounts[cfg["disk_path"]]]
    assert _quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= cfg["disk_size_gib"] * GIB



def test_vllm_memory_counts_the_cache_agents_arena(rendered):
    """Issue 32: each GPU worker's cache agent arena (agent_arena_gib of shared memory, pinned
    for CUDA) is the vLLM pod's memory: the request and the limit are vllm.memory plus one
    arena per worker."""
    values = rendered.values
    resources = rendered.one("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]["resources"]
    workers = max(1, int(values["vllm"]["gpus"]))
    want = _quantity_bytes(values["vllm"]["memory"]) + workers * values["kvblend"]["config"]["agent_arena_gib"] * GIB
    assert _quantity_bytes(resources["requests"]["memory"]) == want
    assert resources["limits"]["memory"] == resources["requests"]["memory"]
