"""The kvblend chart driven through the real helm binary, for tests/helm (no cluster)."""

from __future__ import annotations

import base64
import copy
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kvblend"
VALUES_DIR = Path(__file__).resolve().parent / "values"
GOOD_VALUES = sorted(VALUES_DIR.glob("*.yaml"))
BAD_VALUES = sorted((VALUES_DIR / "bad").glob("*.yaml"))
RELEASE = "kvb"
NAMESPACE = "serving"
# Kubernetes version whose schemas kubernetes-validate ships (checked offline).
K8S_VERSION = "1.35.0"


def deep_merge(base: dict, override: dict) -> dict:
    """Helm's values merge: maps merge key by key, everything else (lists too) replaces."""
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class Rendered:
    """The manifests of one ``helm template`` run and the values that produced them."""

    docs: list[dict]
    values: dict
    stdout: str = ""
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, component: str | None = None) -> dict:
        found = [d for d in self.of_kind(kind)
                 if component is None
                 or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
        return found[0]

    def pod_templates(self) -> list[tuple[str, dict]]:
        """(where, PodTemplateSpec-like {metadata, spec}) for every pod the chart creates."""
        out = []
        for d in self.docs:
            name = f"{d['kind']}/{d['metadata']['name']}"
            if d["kind"] in ("Deployment", "StatefulSet"):
                out.append((name, d["spec"]["template"]))
            elif d["kind"] == "Pod":
                out.append((name, {"metadata": d["metadata"], "spec": d["spec"]}))
            elif d["kind"] == "RayCluster":
                out.append((f"{name}/head", d["spec"]["headGroupSpec"]["template"]))
                for group in d["spec"]["workerGroupSpecs"]:
                    out.append((f"{name}/{group['groupName']}", group["template"]))
        return out

    def containers(self) -> list[tuple[str, dict, dict]]:
        """(where, container, pod spec) for every container and init container."""
        return [(f"{where}/{c['name']}", c, tpl["spec"])
                for where, tpl in self.pod_templates()
                for c in tpl["spec"].get("initContainers", []) + tpl["spec"]["containers"]]


class Helm:
    """The chart driven through the real helm binary."""

    def __init__(self, binary: Path):
        self.binary = str(binary)
        self.defaults = yaml.safe_load((CHART / "values.yaml").read_text())
        self._cache: dict[tuple, Rendered] = {}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        # Never reach a real cluster from the tests, whatever the developer's kubeconfig says.
        env = {**os.environ, "KUBECONFIG": os.devnull}
        proc = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=120,
                              env=env)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def lint(self, values_file: Path | None = None, *sets: str) -> subprocess.CompletedProcess:
        args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
        if values_file is not None:
            args += ["-f", str(values_file)]
        for s in sets:
            args += ["--set", s]
        return self.run(*args, check=False)

    def template(self, values_file: Path | None = None, *sets: str, check: bool = True,
                 ) -> subprocess.CompletedProcess:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        if values_file is not None:
            args += ["-f", str(values_file)]
        for s in sets:
            args += ["--set", s]
        return self.run(*args, check=check)

    def render(self, values_file: Path | None = None, *sets: str) -> Rendered:
        """Render (cached per arguments) and parse; ``sets`` are ``--set`` strings."""
        key = (str(values_file), sets)
        if key not in self._cache:
            proc = self.template(values_file, *sets)
            docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
            values = self.defaults
            if values_file is not None:
                values = deep_merge(values, yaml.safe_load(Path(values_file).read_text()) or {})
            for s in sets:
                path, raw = s.split("=", 1)
                override: dict = {}
                node = override
                parts = path.split(".")
                for part in parts[:-1]:
                    node = node.setdefault(part, {})
                node[parts[-1]] = yaml.safe_load(raw)
                values = deep_merge(values, override)
            secrets = {
                d["metadata"]["name"]: {k: base64.b64decode(v).decode()
                                        for k, v in (d.get("data") or {}).items()}
                for d in docs if d["kind"] == "Secret"}
            self._cache[key] = Rendered(docs=docs, values=values, stdout=proc.stdout, secrets=secrets)
        return self._cache[key]
