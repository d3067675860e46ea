"""The chart's kvblend config: the rendered kvblend.yaml is exactly our config, and the
values schema agrees with cluster/config.py field by field."""

from __future__ import annotations

import json

import pytest
import yaml
from tests.helm._helm_chart import CHART, NAMESPACE, RELEASE

from cluster.config import FIELD_SECTION, FIELDS, describe_fields, load_config

pytestmark = pytest.mark.integration

# Fields the chart fills from its own sections rather than from kvblend.config.
DERIVED = {"model", "ray_address", "redis_url", "s3_url", "s3_endpoint_url", "s3_region",
           "redis_tls_ca_file", "redis_tls_cert_file", "redis_tls_key_file", "redis_password",
           "redis_password_file"}
VALUES_SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def _config_yaml(rendered) -> str:
    cm = rendered.one("ConfigMap", "config")
    assert set(cm["data"]) == {"kvblend.yaml"}
    return cm["data"]["kvblend.yaml"]


def test_configmap_loads_with_every_field_and_no_unknown_key(rendered, tmp_path):
    text = _config_yaml(rendered)
    raw = yaml.safe_load(text)
    assert set(raw) == set(FIELD_SECTION), (set(raw) ^ set(FIELD_SECTION))
    path = tmp_path / "kvblend.yaml"
    path.write_text(text)
    cfg = load_config(str(path), environ={})
    assert all(src == f"file {path}" for src in cfg.sources.values())
    flat = cfg.as_flat_dict()
    # Values from kvblend.config arrive unchanged (lists as tuples, ints as floats).
    for name, value in rendered.values["kvblend"]["config"].items():
        expected = tuple(value) if isinstance(value, list) else value
        assert flat[name] == expected, name
    assert flat["model"] == rendered.values["vllm"]["model"]
    assert flat["ray_address"] == "auto"


def test_configmap_tier_urls_follow_redis_and_s3_sections(rendered, tmp_path):
    path = tmp_path / "kvblend.yaml"
    path.write_text(_config_yaml(rendered))
    flat = load_config(str(path), environ={}).as_flat_dict()
    redis, s3 = rendered.values["redis"], rendered.values["s3"]
    if redis["mode"] == "none":
        assert flat["redis_url"] == ""
    elif redis["mode"] == "internal":
        assert flat["redis_url"] == f"redis://{RELEASE}-kvblend-redis.{NAMESPACE}.svc:6379/0"
    else:
        ext = redis["external"]
        scheme = "rediss" if ext["tls"] else "redis"
        assert flat["redis_url"] == f"{scheme}://{ext['host']}:{ext['port']}/{ext['db']}"
    if s3["enabled"]:
        prefix = f"/{s3['prefix']}" if s3["prefix"] else ""
        assert flat["s3_url"] == f"s3://{s3['bucket']}{prefix}"
        assert flat["s3_endpoint_url"] == s3["endpoint"]
        assert flat["s3_region"] == s3["region"]
    else:
        assert (flat["s3_url"], flat["s3_endpoint_url"], flat["s3_region"]) == ("", "", "")


def test_config_is_mounted_and_pointed_to_by_kvblend_config(rendered):
    cm_name = rendered.one("ConfigMap", "config")["metadata"]["name"]
    kvblend_containers = 0
    for where, container, spec in rendered.containers():
        env = {e["name"]: e for e in container.get("env", [])}
        if "KVBLEND_CONFIG" not in env:
            continue
        kvblend_containers += 1
        assert env["KVBLEND_CONFIG"]["value"] == "/etc/kvblend/kvblend.yaml", where
        mount = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/kvblend"]
        assert len(mount) == 1, where
        volume = [v for v in spec["volumes"] if v["name"] == mount[0]["name"]]
        assert volume[0]["configMap"]["name"] == cm_name, where
    # head, shards, vLLM and the test hook
    assert kvblend_containers == 4


def test_kvblend_env_vars_are_config_fields(rendered):
    """cluster.env refuses unknown KVBLEND_* variables at start-up: the chart sets none."""
    from cluster import env as envmod
    from cluster.config import FIELD_SECTION

    for where, container, _ in rendered.containers():
        names = {e["name"]: "x" for e in container.get("env", []) if e["name"].startswith("KVBLEND_")}
        list(envmod.config_values(names, FIELD_SECTION))  # raises ValueError on an unknown one
        # KVBLEND_NODE_NAME (shards) and KVBLEND_OBJECT_KEY are no config fields but known
        # variables (cluster/env.py)
        assert set(names) <= {"KVBLEND_CONFIG", "KVBLEND_REDIS_PASSWORD", "KVBLEND_LOCAL_FALLBACK",
                              "KVBLEND_NODE_NAME", "KVBLEND_OBJECT_KEY", "KVBLEND_REDIS_TLS_CA_FILE",
                              "KVBLEND_REDIS_TLS_CERT_FILE", "KVBLEND_REDIS_TLS_KEY_FILE"}, where


def test_values_schema_covers_exactly_the_config_fields():
    schema_props = VALUES_SCHEMA["properties"]["kvblend"]["properties"]["config"]["properties"]
    assert set(schema_props) | DERIVED == set(FIELD_SECTION)
    assert not set(schema_props) & DERIVED
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["kvblend"]["config"]
    assert set(defaults) == set(schema_props)


@pytest.mark.parametrize("row", [r for r in describe_fields() if r["name"] not in DERIVED],
                         ids=lambda r: r["name"])
def test_values_schema_bounds_match_config_metadata(row):
    prop = VALUES_SCHEMA["properties"]["kvblend"]["properties"]["config"]["properties"][row["name"]]
    meta = FIELDS[row["name"]].metadata
    target = prop["items"] if prop["type"] == "array" else prop
    if "range" in meta:
        assert (target["minimum"], target["maximum"]) == tuple(meta["range"])
    else:
        assert "minimum" not in target and "maximum" not in target
    if "choices" in meta:
        assert target["enum"] == list(meta["choices"])
    expected_type = {"int": "integer", "float": "number", "bool": "boolean", "str": "string"}
    kind = row["type"].rsplit(" ", 1)[-1]
    assert target["type"] == expected_type[kind]


def test_default_values_are_a_valid_config():
    from cluster.config import build, parse_value

    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["kvblend"]["config"]
    build({k: parse_value(k, v, f"values.yaml:{k}") for k, v in defaults.items()})


def test_blend_separator_survives_rendering(helm):
    """The default separator starts and ends with a newline: YAML block scalars must keep both."""
    rendered = helm.render(None)
    raw = yaml.safe_load(rendered.one("ConfigMap", "config")["data"]["kvblend.yaml"])
    assert raw["blend_separator"] == "\n# #\n"


def test_connector_extra_config_takes_only_config_fields(helm):
    schema = VALUES_SCHEMA["properties"]["vllm"]["properties"]["connectorExtraConfig"]
    assert set(schema["propertyNames"]["enum"]) == set(FIELD_SECTION)
    assert helm.template(None, "vllm.connectorExtraConfig.recompute_ratio=0.2",
                         check=False).returncode != 0
    rendered = helm.render(None, "vllm.connectorExtraConfig.store_kv=false")
    args = rendered.one("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"store_kv": False, "allow_request_overrides": False}


def test_request_overrides_are_off_unless_the_operator_allows_them(helm):
    """Issue 19: API users cannot turn storing, loading or recompute off for everyone by
    default; ``vllm.allowRequestOverrides=true`` lets them (the connector option it sets is
    checked by the connector's own tests)."""
    from cluster.vllm.options import ConnectorOptions

    for value, want in ((None, False), ("true", True)):
        rendered = helm.render(None, *([f"vllm.allowRequestOverrides={value}"] if value else []))
        args = rendered.one("Deployment", "vllm")["spec"]["template"]["spec"]["containers"][0]["args"]
        extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
        assert ConnectorOptions.pop_from(dict(extra)).allow_request_overrides is want
    assert helm.template(None, "vllm.allowRequestOverrides=maybe", check=False).returncode != 0
