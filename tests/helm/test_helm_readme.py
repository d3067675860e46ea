"""The README's (and the deployment guide's) ``helm install`` lines render what they promise.

Each ``helm install`` command in a ``bash`` block is run as ``helm template`` with exactly its
flags (``--set``, ``-f``, ``--namespace``, ...). The result must serve the model the line names
with the kvblend connector, keep the vLLM pods' local fallback out of the container layer, and
give the shard pods their stable node name (``KVBLEND_NODE_NAME``, cluster/cache/identity.py).
"""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from tests.helm._helm_chart import CHART, REPO, Rendered, deep_merge

from cluster.config import load_config

pytestmark = pytest.mark.integration

DOCS = [REPO / "README.md", REPO / "docs" / "deploy-kubernetes.md"]


def helm_install_lines(path) -> list[list[str]]:
    """Every ``helm install`` command of the ``bash`` blocks in ``path``, as argv lists
    (backslash continuations joined, comments dropped)."""
    out = []
    for block in path.read_text().split("```bash")[1:]:
        text = block.split("```", 1)[0].replace("\\\n", " ")
        for line in text.splitlines():
            if not line.lstrip().startswith("helm install"):
                continue  # other commands (a curl with a multi-line JSON body) are not ours to parse
            argv = shlex.split(line, comments=True)
            if argv[:2] == ["helm", "install"]:
                out.append(argv)
    return out


COMMANDS = [(p.name, argv) for p in DOCS for argv in helm_install_lines(p)
            if argv[3:4] == ["./helm/kvblend"]]


def _render(helm, argv: list[str]) -> Rendered:
    """``helm template`` with the install line's own arguments; ``values`` are the chart's
    defaults merged with its ``-f`` file and ``--set`` flags, as Helm merges them."""
    release, chart, flags = argv[2], argv[3], list(argv[4:])
    assert chart == "./helm/kvblend"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    args, i = [], 0
    while i < len(flags):
        flag = flags[i]
        if flag in ("-f", "--values"):
            path = REPO / flags[i + 1]  # paths are relative to the repository
            values = deep_merge(values, yaml.safe_load(path.read_text()) or {})
            args += [flag, str(path)]
            i += 2
            continue
        if flag == "--set":
            key, raw = flags[i + 1].split("=", 1)
            override = node = {}
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = yaml.safe_load(raw)
            values = deep_merge(values, override)
        args.append(flag)
        i += 1
    proc = helm.run("template", release, str(CHART), *args)
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return Rendered(docs=docs, values=values, stdout=proc.stdout)


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _effective_config(rendered: Rendered, container: dict, tmp_path, extra_env=None):
    """The config a kvblend process of ``container`` loads: the ConfigMap's kvblend.yaml
    under the container's literal ``KVBLEND_*`` variables."""
    path = tmp_path / "kvblend.yaml"
    path.write_text(rendered.one("ConfigMap", "config")["data"]["kvblend.yaml"])
    environ = {k: e["value"] for k, e in _env(container).items()
               if k.startswith("KVBLEND_") and "value" in e and k != "KVBLEND_CONFIG"}
    return load_config(str(path), environ={**environ, **(extra_env or {})})


def test_the_readme_has_its_helm_install_line():
    readme = [argv for name, argv in COMMANDS if name == "README.md"]
    assert len(readme) == 1, readme
    assert "vllm.model=Qwen/Qwen2.5-7B-Instruct" in readme[0]


@pytest.mark.parametrize(("doc", "argv"), COMMANDS, ids=[f"{n}:{a[2]}" for n, a in COMMANDS])
def test_helm_install_line_renders_a_working_release(helm, doc, argv, tmp_path):
    rendered = _render(helm, argv)
    v = rendered.values
    vllm = rendered.one("Deployment", "vllm")
    spec = vllm["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    args = container["args"]

    # the model the line names (or its values file / the chart's default), by Hub id
    model = v["vllm"]["model"]
    if doc == "README.md":
        assert model == "Qwen/Qwen2.5-7B-Instruct"
    assert args[0] == model
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "KVBlendConnector"
    assert kv["kv_connector_module_path"] == "cluster.connector"
    cfg = _effective_config(rendered, container, tmp_path)
    assert cfg.as_flat_dict()["model"] == model

    # the vLLM pod never caches into its container layer while the shards are unreachable
    fallback = cfg.cluster.local_fallback
    assert _env(container)["KVBLEND_LOCAL_FALLBACK"]["value"] == fallback
    if doc == "README.md":
        assert fallback in ("off", "memory")
    if fallback == "disk":  # only onto a volume mounted over the directory it writes
        root = cfg.tiers.disk_path or cfg.as_flat_dict()["cache_dir"]
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(root == m or root.startswith(m.rstrip("/") + "/") for m in mounts), (root, mounts)
    else:
        assert fallback in ("off", "memory")

    # shard pods: a stable node name from the downward API; the ConfigMap keeps the shards'
    # own local_fallback (the vLLM pods' setting is theirs alone)
    (group,) = rendered.one("RayCluster")["spec"]["workerGroupSpecs"]
    (shard,) = group["template"]["spec"]["containers"]
    env = _env(shard)
    want = "spec.nodeName" if v["shards"]["disk"]["type"] == "hostPath" else "metadata.name"
    assert env["KVBLEND_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == want
    assert "KVBLEND_LOCAL_FALLBACK" not in env
    shard_cfg = _effective_config(rendered, shard, tmp_path, {"KVBLEND_NODE_NAME": "node-1"})
    assert shard_cfg.cluster.local_fallback == v["kvblend"]["config"]["local_fallback"]
