"""The chart lints, renders and validates offline; bad values are refused.

Core resources are checked with kubernetes-validate (Kubernetes' own OpenAPI schemas,
shipped in the package); the RayCluster's pod templates as core/v1 PodTemplates and its
own fields against tests/helm/raycluster.schema.json.
"""

from __future__ import annotations

import copy
import json
import tarfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from tests.helm._helm_chart import CHART, K8S_VERSION, NAMESPACE, RELEASE

pytestmark = pytest.mark.integration

# CRDs of operators we do not validate with kubernetes-validate (not in its schemas).
CUSTOM_API_GROUPS = ("ray.io/", "monitoring.coreos.com/")
RAYCLUSTER_SCHEMA = json.loads((Path(__file__).parent / "raycluster.schema.json").read_text())


def test_lint_strict(helm, values_file):
    proc = helm.lint(values_file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_renders_every_component(rendered):
    kinds = {d["kind"] for d in rendered.docs}
    assert {"RayCluster", "Deployment", "Service", "ConfigMap", "Pod"} <= kinds
    assert rendered.one("Service", "ray-head")
    assert rendered.one("Deployment", "vllm")["spec"]["replicas"] == rendered.values["vllm"]["replicas"]
    workers = rendered.one("RayCluster")["spec"]["workerGroupSpecs"]
    assert [w["replicas"] for w in workers] == [rendered.values["shards"]["replicas"]]
    # Optional parts appear exactly when switched on.
    v = rendered.values
    assert bool(rendered.of_kind("StatefulSet")) == (v["redis"]["mode"] == "internal")
    assert bool(rendered.of_kind("PodDisruptionBudget")) == v["shards"]["pdb"]["enabled"]
    assert bool(rendered.of_kind("ServiceMonitor")) == v["metrics"]["serviceMonitor"]["enabled"]
    assert bool(rendered.of_kind("PodMonitor")) == v["metrics"]["podMonitor"]["enabled"]


def test_core_resources_validate_against_kubernetes_schemas(rendered):
    checked = 0
    for doc in rendered.docs:
        if doc["apiVersion"].startswith(CUSTOM_API_GROUPS):
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e}")
        checked += 1
    assert checked >= 6


def test_raycluster_pod_templates_are_valid_pod_template_specs(rendered):
    cluster = rendered.one("RayCluster")
    templates = [cluster["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in cluster["spec"]["workerGroupSpecs"]]
    for i, template in enumerate(templates):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"check-{i}"}, "template": template}
        try:
            kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"RayCluster pod template {i}: {e}")


def test_kubernetes_validate_catches_a_broken_pod_template(rendered):
    """The validation above has teeth: a misplaced field in a pod template is reported."""
    template = copy.deepcopy(rendered.one("RayCluster")["spec"]["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["memory"] = "1Gi"  # belongs under resources
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": "x"}, "template": template},
                                     K8S_VERSION, strict=True)


def test_raycluster_fields_match_our_schema(rendered):
    cluster = rendered.one("RayCluster")
    jsonschema.validate(cluster, RAYCLUSTER_SCHEMA)
    broken = copy.deepcopy(cluster)
    broken["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 0  # not a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAYCLUSTER_SCHEMA)


def test_raycluster_uses_the_pinned_ray_version(rendered):
    import tomllib

    pyproject = tomllib.loads((CHART.parents[1] / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["dependencies"] if d.startswith("ray[")]
    assert pins and pins[0].split("==")[1] == rendered.one("RayCluster")["spec"]["rayVersion"]


def test_selectors_match_their_pods(rendered):
    """Services, the PDB and monitors select exactly the pods they are meant for."""
    pods = {where: tpl["metadata"]["labels"] for where, tpl in rendered.pod_templates()}

    def selected(selector: dict) -> set[str]:
        return {w for w, labels in pods.items() if selector.items() <= labels.items()}

    head = rendered.one("Service", "ray-head")
    assert selected(head["spec"]["selector"]) == {f"RayCluster/{RELEASE}-kvblend/head"}
    vllm = rendered.one("Service", "vllm")
    assert selected(vllm["spec"]["selector"]) == {f"Deployment/{RELEASE}-kvblend-vllm"}
    deployment = rendered.one("Deployment", "vllm")
    assert selected(deployment["spec"]["selector"]["matchLabels"]) == {f"Deployment/{RELEASE}-kvblend-vllm"}
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        assert selected(pdb["spec"]["selector"]["matchLabels"]) == {
            f"RayCluster/{RELEASE}-kvblend/cache-shards"}
    for sts in rendered.of_kind("StatefulSet"):
        assert selected(sts["spec"]["selector"]["matchLabels"]) == {f"StatefulSet/{sts['metadata']['name']}"}
    for pm in rendered.of_kind("PodMonitor"):
        sel = pm["spec"]["selector"]
        components = set(sel["matchExpressions"][0]["values"])
        hit = {w for w in selected(sel["matchLabels"])
               if pods[w].get("app.kubernetes.io/component") in components}
        assert hit == {f"RayCluster/{RELEASE}-kvblend/head", f"RayCluster/{RELEASE}-kvblend/cache-shards",
                       f"Deployment/{RELEASE}-kvblend-vllm"}
    # Named target ports exist on the selected pods' containers.
    deployment_ports = {p["name"] for c in deployment["spec"]["template"]["spec"]["containers"]
                        for p in c.get("ports", [])}
    assert {p["targetPort"] for p in vllm["spec"]["ports"]} <= deployment_ports
    head_tpl = rendered.one("RayCluster")["spec"]["headGroupSpec"]["template"]
    head_ports = {p["name"] for c in head_tpl["spec"]["containers"] for p in c.get("ports", [])}
    assert {p["targetPort"] for p in head["spec"]["ports"]} <= head_ports
    assert {p["port"] for p in head["spec"]["ports"]} >= {6379}
    # The dashboard has its own Service (issue 19), in front of the same head pod.
    dashboard = rendered.one("Service", "ray-dashboard")
    assert selected(dashboard["spec"]["selector"]) == {f"RayCluster/{RELEASE}-kvblend/head"}
    assert {p["targetPort"] for p in dashboard["spec"]["ports"]} <= head_ports


def test_standard_labels_everywhere(rendered):
    required = {"helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                "app.kubernetes.io/version", "app.kubernetes.io/managed-by"}
    for doc in rendered.docs:
        missing = required - set(doc["metadata"].get("labels", {}))
        assert not missing, f"{doc['kind']}/{doc['metadata']['name']} lacks labels {missing}"
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    for where, tpl in rendered.pod_templates():
        assert "app.kubernetes.io/component" in tpl["metadata"]["labels"], where


def test_every_container_has_requests_and_limits(rendered):
    for where, container, _ in rendered.containers():
        res = container.get("resources", {})
        for part in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res.get(part, {})), f"{where}: {part} {res}"


def test_vllm_replicas(rendered):
    v = rendered.values["vllm"]
    deployment = rendered.one("Deployment", "vllm")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[0] == v["model"]
    assert container["command"][:2] == ["/bin/bash", "-c"]
    script = container["command"][2]
    assert 'exec vllm serve "$@"' in script
    # Joins Ray as a node with no CPUs, no GPUs and no shard resource: hosts no shards.
    assert "ray start --address=\"$RAY_HEAD_ADDRESS\"" in script
    assert "--num-cpus=0" in script and "--num-gpus=0" in script and "--resources" not in script
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "KVBlendConnector"
    assert kv["kv_connector_module_path"] == "cluster.connector"
    assert kv["kv_role"] == "kv_both"
    # the chart's overrides plus allow_request_overrides (vllm.allowRequestOverrides, issue 19)
    assert kv["kv_connector_extra_config"] == {**v["connectorExtraConfig"],
                                               "allow_request_overrides": v["allowRequestOverrides"]}
    for arg in v["extraArgs"]:
        assert arg in args
    limits = container["resources"]["limits"]
    if v["gpus"] > 0:
        assert limits["nvidia.com/gpu"] == v["gpus"]
    else:
        assert "nvidia.com/gpu" not in limits
    if v["gpus"] > 1:
        assert args[args.index("--tensor-parallel-size") + 1] == str(v["gpus"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": v["port"], "protocol": "TCP"} in container["ports"]


@pytest.mark.parametrize("sets", [
    ("vllm.replicas=-1",),
    ("shards.replicas=0",),
    ("vllm.gpus=1.5",),
    ("shards.disk.type=nfs",),
    ("kvblend.config.chunk_size=8",),
    ("kvblend.config.object_store_gib=0",),
    ("kvblend.config.shard_resource=",),
    ("kvblend.config.disk_path=relative/dir",),
    ("unknownTopLevel=1",),
], ids=lambda s: s[0])
def test_schema_rejects_bad_set_values(helm, sets):
    lint = helm.lint(None, *sets)
    assert lint.returncode != 0, f"helm lint accepted {sets}"
    template = helm.template(None, *sets, check=False)
    assert template.returncode != 0, f"helm template accepted {sets}"
    assert "schema" in template.stderr.lower() or "values don't meet" in template.stderr.lower()


def test_bad_values_files_are_refused(helm, bad_values_file):
    lint = helm.lint(bad_values_file)
    assert lint.returncode != 0, f"helm lint accepted {bad_values_file.name}"
    template = helm.template(bad_values_file, check=False)
    assert template.returncode != 0, f"helm template accepted {bad_values_file.name}"
    # The message names the offending key.
    bad_keys = {"negative-replicas": "replicas", "unknown-key": "replicsa",
                "unknown-config-key": "recompute_ratio", "negative-gpus": "gpus",
                "external-redis-no-host": "host", "s3-no-bucket": "bucket",
                "privileged": "privileged", "ratio-out-of-range": "recompute_ratios",
                "bad-compression": "compression", "redis-url-in-config": "redis_url"}
    assert bad_keys[bad_values_file.stem] in template.stderr, template.stderr


def test_notes_say_how_to_reach_dashboard_status_and_first_request(helm, tmp_path):
    proc = helm.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{RELEASE}-kvblend-dashboard 8265:8265" in notes
    assert "kvblend status" in notes
    assert "/v1/chat/completions" in notes
    assert f"helm test {RELEASE}" in notes
    assert f"get secret {RELEASE}-kvblend-ray-token" in notes


def test_helm_test_hook_runs_kvblend_status(rendered):
    pods = rendered.of_kind("Pod")
    assert len(pods) == 1
    pod = pods[0]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["command"][-1]
    assert "kvblend status" in script
    assert "ray start --address=\"$RAY_HEAD_ADDRESS\"" in script
    assert pod["spec"]["restartPolicy"] == "Never"


def test_packaged_chart_keeps_the_values_schema(helm, tmp_path):
    helm.run("package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("kvblend-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert "kvblend/values.schema.json" in names
    assert "kvblend/templates/NOTES.txt" in names
    assert "kvblend/files/grafana/kvblend.json" in names


def test_grafana_dashboard_configmap(helm):
    rendered = helm.render(None, "metrics.grafanaDashboard.enabled=true")
    cm = rendered.one("ConfigMap", "grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kvblend.json"])
    assert dashboard["panels"] and all(p["targets"] for p in dashboard["panels"])


def test_chart_dashboard_matches_the_repository_dashboard():
    """Helm cannot read files outside the chart, so the chart carries a copy."""
    repo_dashboard = CHART.parents[1] / "cluster" / "grafana" / "kvblend.json"
    if not repo_dashboard.exists():
        pytest.skip("cluster/grafana/kvblend.json is not written yet; the chart ships its own")
    chart_dashboard = CHART / "files" / "grafana" / "kvblend.json"
    assert json.loads(chart_dashboard.read_text()) == json.loads(repo_dashboard.read_text())
