"""The chart opens no more than it needs (issue 19, item 4), on real ``helm template`` output.

- Two Services in front of the Ray head: ``<fullname>-head`` carries the GCS (6379) and Ray
  Client (10001) ports and is always ClusterIP (every Ray node of the release joins through
  it); ``<fullname>-dashboard`` carries the dashboard (8265) alone, with the type and
  annotations of ``head.dashboardService``, so exposing the dashboard exposes nothing else.
- NetworkPolicies, on by default, for the Ray head, the cache shards, the vLLM pods and the
  internal Redis: every TCP port from the release's own pods; the dashboard port also from
  ``networkPolicy.adminCIDRs`` and ``dashboardFrom``; Ray's metrics port (8080) also from
  ``networkPolicy.metricsFrom``; vLLM's OpenAI port from anywhere, as without a policy.

``tests/helm/values/exposed-dashboard.yaml`` sets every one of these knobs (the other chart
tests lint, validate and check the labels of that file too).
"""

from __future__ import annotations

import kubernetes_validate
import pytest
from tests.helm._helm_chart import K8S_VERSION, NAMESPACE, RELEASE, VALUES_DIR, Rendered

pytestmark = pytest.mark.integration

EXPOSED = VALUES_DIR / "exposed-dashboard.yaml"
GCS_SERVICE = f"{RELEASE}-kvblend-head"
DASHBOARD_SERVICE = f"{RELEASE}-kvblend-dashboard"
# The labels every pod of the release carries (kvblend.selectorLabels).
RELEASE_PODS = {"app.kubernetes.io/name": "kvblend", "app.kubernetes.io/instance": RELEASE}
HEAD_POD = f"RayCluster/{RELEASE}-kvblend/head"
SHARD_PODS = f"RayCluster/{RELEASE}-kvblend/cache-shards"
VLLM_PODS = f"Deployment/{RELEASE}-kvblend-vllm"
REDIS_POD = f"StatefulSet/{RELEASE}-kvblend-redis"
ALL_TCP = [{"protocol": "TCP"}]
DASHBOARD_PORT = [{"port": 8265, "protocol": "TCP"}]
METRICS_PORT = [{"port": 8080, "protocol": "TCP"}]


def _service(rendered: Rendered, name: str) -> dict:
    (svc,) = [d for d in rendered.of_kind("Service") if d["metadata"]["name"] == name]
    return svc


def _selected(rendered: Rendered, selector: dict) -> set[str]:
    """Pod templates (``Kind/name[/group]``) whose labels include ``selector``."""
    return {where for where, tpl in rendered.pod_templates()
            if selector.items() <= tpl["metadata"]["labels"].items()}


def _policies(rendered: Rendered) -> dict[str, dict]:
    """NetworkPolicies by the pods they protect: {``Kind/name[/group]``: policy}."""
    out = {}
    for policy in rendered.of_kind("NetworkPolicy"):
        selector = policy["spec"]["podSelector"]
        assert set(selector) == {"matchLabels"}, policy["metadata"]["name"]
        for where in _selected(rendered, selector["matchLabels"]):
            assert where not in out, f"{where} is selected by two NetworkPolicies"
            out[where] = policy
    return out


def _rules(rendered: Rendered) -> list[tuple[str, dict]]:
    """(policy name, ingress rule) of every NetworkPolicy."""
    return [(p["metadata"]["name"], rule) for p in rendered.of_kind("NetworkPolicy")
            for rule in p["spec"].get("ingress", [])]


def _is_release_pods(peer: dict) -> bool:
    """A peer naming exactly the pods of this release, in the policy's own namespace."""
    return peer == {"podSelector": {"matchLabels": RELEASE_PODS}}


@pytest.mark.parametrize("sets", [(), ("head.dashboardService.type=LoadBalancer",),
                                  ("head.dashboardService.type=NodePort",)],
                         ids=["default", "LoadBalancer", "NodePort"])
def test_gcs_service_is_cluster_ip_without_the_dashboard(helm, sets):
    rendered = helm.render(None, "head.dashboardService.annotations.team=ops", *sets)
    gcs = _service(rendered, GCS_SERVICE)
    assert gcs["spec"]["type"] == "ClusterIP"
    assert {(p["name"], p["port"]) for p in gcs["spec"]["ports"]} == {("gcs-server", 6379),
                                                                      ("client", 10001)}
    assert "annotations" not in gcs["metadata"] and "externalTrafficPolicy" not in gcs["spec"]
    assert _selected(rendered, gcs["spec"]["selector"]) == {HEAD_POD}
    # Everything that joins Ray joins through this Service.
    joining = {where: {e["name"]: e.get("value") for e in c.get("env", [])}.get("RAY_HEAD_ADDRESS")
               for where, c, _ in rendered.containers()}
    assert set(joining.values()) - {None} == {f"{GCS_SERVICE}.{NAMESPACE}.svc:6379"}
    assert sum(v is not None for v in joining.values()) >= 4  # head, shards, vLLM, test hook


def test_dashboard_service_carries_only_the_dashboard(helm):
    only_dashboard = [{"name": "dashboard", "port": 8265, "targetPort": "dashboard", "protocol": "TCP"}]
    default = helm.render(None)
    svc = _service(default, DASHBOARD_SERVICE)
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"] == only_dashboard
    assert _selected(default, svc["spec"]["selector"]) == {HEAD_POD}

    exposed = helm.render(EXPOSED)
    svc = _service(exposed, DASHBOARD_SERVICE)
    assert svc["spec"]["type"] == "LoadBalancer" and svc["spec"]["ports"] == only_dashboard
    assert svc["spec"]["externalTrafficPolicy"] == "Local"
    assert svc["metadata"]["annotations"] == exposed.values["head"]["dashboardService"]["annotations"]
    assert _selected(exposed, svc["spec"]["selector"]) == {HEAD_POD}
    # The dashboard is the only head port any Service exposes beyond ClusterIP, and 8265 is
    # on no other Service.
    for other in exposed.of_kind("Service"):
        if other["metadata"]["name"] in (DASHBOARD_SERVICE, f"{RELEASE}-kvblend-vllm"):
            continue
        assert other["spec"]["type"] == "ClusterIP", other["metadata"]["name"]
        assert 8265 not in {p["port"] for p in other["spec"]["ports"]}, other["metadata"]["name"]


def test_external_traffic_policy_needs_an_exposed_dashboard(helm):
    ok = helm.lint(None, "head.dashboardService.type=NodePort",
                   "head.dashboardService.externalTrafficPolicy=Local")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = helm.template(None, "head.dashboardService.externalTrafficPolicy=Local", check=False)
    assert bad.returncode != 0 and "externalTrafficPolicy" in bad.stderr, bad.stderr


def test_network_policies_select_head_shards_vllm_and_redis(rendered):
    """On by default in every values file; one ingress-only policy per kvblend pod."""
    policies = _policies(rendered)
    expected = {HEAD_POD, SHARD_PODS, VLLM_PODS}
    if rendered.values["redis"]["mode"] == "internal":
        expected.add(REDIS_POD)
    assert set(policies) == expected
    assert len(rendered.of_kind("NetworkPolicy")) == len(expected)
    for where, policy in policies.items():
        assert policy["spec"]["policyTypes"] == ["Ingress"], where
        assert "egress" not in policy["spec"], where


def test_release_pods_reach_every_tcp_port_of_each_other(rendered):
    """Ray's many ports between its own nodes: all TCP from the release's pods, which are
    every pod the chart creates (the test hook too, it joins Ray)."""
    assert _selected(rendered, RELEASE_PODS) == {w for w, _ in rendered.pod_templates()}
    assert set(_policies(rendered)) >= {HEAD_POD, SHARD_PODS, VLLM_PODS}
    for policy in rendered.of_kind("NetworkPolicy"):
        rules = policy["spec"]["ingress"]
        assert {"from": [{"podSelector": {"matchLabels": RELEASE_PODS}}], "ports": ALL_TCP} in rules, \
            policy["metadata"]["name"]


def test_by_default_only_the_release_and_vllm_api_clients_get_in(helm):
    rendered = helm.render(None, "redis.mode=internal")
    vllm_port = rendered.values["vllm"]["port"]
    assert {name for name, _ in _rules(rendered)} == {
        f"{RELEASE}-kvblend-{part}" for part in ("ray-head", "cache-shard", "vllm", "redis")}
    for name, rule in _rules(rendered):
        if "from" not in rule:  # open to every source: vLLM's API port only
            assert name == f"{RELEASE}-kvblend-vllm" and rule["ports"] == [
                {"port": vllm_port, "protocol": "TCP"}], (name, rule)
            continue
        assert rule["from"] and all(_is_release_pods(peer) for peer in rule["from"]), (name, rule)
        assert rule["ports"] == ALL_TCP, (name, rule)


def test_vllm_api_port_stays_open_to_everyone(rendered):
    deployment = rendered.one("Deployment", "vllm")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    policy = _policies(rendered)[VLLM_PODS]
    open_rules = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert open_rules == [{"ports": [{"port": http, "protocol": "TCP"}]}]
    # and nothing else of vLLM's pod is open to every source
    assert all(r["from"] for r in policy["spec"]["ingress"] if "from" in r)


def test_admin_cidrs_reach_the_dashboard_port_only(helm):
    rendered = helm.render(EXPOSED)
    np_values = rendered.values["networkPolicy"]
    head_policy = _policies(rendered)[HEAD_POD]["metadata"]["name"]
    cidr_rules = [(name, rule) for name, rule in _rules(rendered)
                  if any("ipBlock" in peer for peer in rule.get("from", []))]
    assert len(cidr_rules) == 1
    name, rule = cidr_rules[0]
    assert name == head_policy and rule["ports"] == DASHBOARD_PORT
    assert [p["ipBlock"] for p in rule["from"] if "ipBlock" in p] == [
        {"cidr": c} for c in np_values["adminCIDRs"]]
    # dashboardFrom joins the admin CIDRs on the dashboard port, and no other rule names it
    assert [p for p in rule["from"] if "ipBlock" not in p] == np_values["dashboardFrom"]
    for other_name, other in _rules(rendered):
        if other is rule:
            continue
        assert not any("ipBlock" in p for p in other.get("from", [])), other_name
        assert not any(p in other.get("from", []) for p in np_values["dashboardFrom"]), other_name
        assert 8265 not in {p.get("port") for p in other["ports"]}, other_name


def test_metrics_from_reaches_the_metrics_port_only(helm):
    rendered = helm.render(EXPOSED)
    metrics_from = rendered.values["networkPolicy"]["metricsFrom"]
    policies = _policies(rendered)
    for where in (HEAD_POD, SHARD_PODS, VLLM_PODS):
        rules = policies[where]["spec"]["ingress"]
        assert {"from": metrics_from, "ports": METRICS_PORT} in rules, where
    for name, rule in _rules(rendered):
        if rule.get("from") == metrics_from:
            assert rule["ports"] == METRICS_PORT, name
        else:
            assert not any(p in rule.get("from", []) for p in metrics_from), name
    redis_rules = policies[REDIS_POD]["spec"]["ingress"]
    assert all(all(_is_release_pods(p) for p in r["from"]) for r in redis_rules)


def test_network_policy_disabled_renders_none(helm):
    assert len(helm.render(None).of_kind("NetworkPolicy")) == 3  # head, shards, vLLM
    assert len(helm.render(EXPOSED).of_kind("NetworkPolicy")) == 4  # and the internal Redis
    for values_file in (None, EXPOSED):
        off = helm.render(values_file, "networkPolicy.enabled=false")
        assert off.of_kind("NetworkPolicy") == []
        # the Service split does not depend on it
        assert _service(off, GCS_SERVICE)["spec"]["type"] == "ClusterIP"
        assert [p["port"] for p in _service(off, DASHBOARD_SERVICE)["spec"]["ports"]] == [8265]
    lint = helm.lint(EXPOSED, "networkPolicy.enabled=false")
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("chart_values", [None, EXPOSED], ids=["defaults", "exposed-dashboard"])
def test_policies_and_services_validate_against_kubernetes_schemas(helm, chart_values):
    rendered = helm.render(chart_values)
    docs = rendered.of_kind("NetworkPolicy") + rendered.of_kind("Service")
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e}")
    assert len(rendered.of_kind("NetworkPolicy")) >= 3
    assert {GCS_SERVICE, DASHBOARD_SERVICE} <= {d["metadata"]["name"] for d in docs}


@pytest.mark.parametrize(("good", "bad"), [
    ("networkPolicy.adminCIDRs[0]=10.0.0.0/8", "networkPolicy.adminCIDRs[0]=10.0.0.1"),
    ("networkPolicy.adminCIDRs[0]=fd00::/8", "networkPolicy.adminCIDRs[0]=everyone"),
    ("networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=obs",
     "networkPolicy.metricsFrom[0].namespace=obs"),
    ("networkPolicy.dashboardFrom[0].ipBlock.cidr=10.1.0.0/16",
     "networkPolicy.dashboardFrom[0].ipBlock.except[0]=10.1.2.0/24"),
    ("head.dashboardService.externalTrafficPolicy=Cluster",
     "head.dashboardService.externalTrafficPolicy=Nearest"),
], ids=["cidr-without-prefix", "not-a-cidr", "unknown-peer-key", "ipblock-without-cidr",
        "unknown-traffic-policy"])
def test_schema_checks_network_values(helm, good, bad):
    extra = ("head.dashboardService.type=LoadBalancer",) if "TrafficPolicy" in good else ()
    ok = helm.lint(None, good, *extra)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = helm.lint(None, bad, *extra)
    assert refused.returncode != 0, f"helm lint accepted {bad}"
