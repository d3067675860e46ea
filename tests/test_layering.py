"""The shape of the house, as tests: imports go one way (``cluster -> blend -> tiers``), no
import cycle, modules readable in one sitting, the cluster wings kept apart, and the names
users and vLLM configure (``cluster.connector``, the ``kvblend`` script, the vLLM plugin) still
resolve.

The import graph is read from the source (AST), module by module, over ``cluster/``, ``blend/``
and ``tiers/``. Every import counts: at module level, inside functions, under
``TYPE_CHECKING``. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module and
always to ``pkg`` (whose ``__init__`` runs first); relative imports are resolved.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest
import tomllib

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("tiers", "blend", "cluster")  # lowest layer first
LAYER = {name: i for i, name in enumerate(PACKAGES)}
MAX_MODULE_LINES = 500
CLUSTER_WINGS = ("cluster.cache", "cluster.vllm", "cluster.cli", "cluster.workloads", "cluster.bench")


def _module_files() -> dict[str, pathlib.Path]:
    """``{"cluster.cache.client": Path(...), "cluster.cache": Path(.../__init__.py), ...}``."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _owning_module(name: str) -> str | None:
    """The longest prefix of dotted ``name`` that is one of our modules (None: not ours)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports_in(source: str, module: str, is_package: bool = False) -> set[str]:
    """Our modules that ``source`` (the text of ``module``) imports, anywhere in it."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of this module, level - 1 levels up
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            names += [f"{base}.{alias.name}" for alias in node.names] + [base]
    found = {_owning_module(name) for name in names}
    return {m for m in found if m is not None and m != module}


def _imports_of(module: str) -> set[str]:
    path = MODULES[module]
    return _imports_in(path.read_text(), module, is_package=path.name == "__init__.py")


GRAPH = {module: _imports_of(module) for module in MODULES}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest import cycle through the first module of ``component``: ``[a, b, ..., a]``."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    return " -> ".join(_one_cycle(graph, component)) + f"  (one strongly connected component of {len(component)}: {', '.join(component)})"


def test_graph_sees_imports_in_functions_type_checking_and_relative_forms():
    """Every form of import is an edge (the input of the cycle test, checked on a sample)."""
    sample = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from tiers.keys import ChunkKey\n"
              "def f():\n    import blend.plan\n    from . import planner\n    from .config import X\n")
    got = _imports_in(sample, "blend.probe")
    assert got == {"tiers.keys", "blend.plan", "blend.planner", "blend.config", "blend"}, got


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"b"}, "e": set()}
    assert _strongly_connected(graph) == [["a", "b", "c", "d"]]
    assert _one_cycle(graph, ["a", "b", "c", "d"]) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    components = _strongly_connected(GRAPH)
    assert not components, "import cycles:\n" + "\n".join(_describe(GRAPH, c) for c in components)


def test_imports_go_one_way():
    """``cluster -> blend -> tiers``: tiers imports neither, blend never imports cluster."""
    bad = [f"{a} imports {b}" for a, deps in sorted(GRAPH.items()) for b in sorted(deps)
           if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]]
    assert not bad, "imports against cluster -> blend -> tiers:\n" + "\n".join(bad)


def test_bookkeeping_modules_do_not_import_torch():
    for rel in ("tiers/keys.py", "tiers/format.py", "tiers/tier.py", "blend/plan.py"):
        tree = ast.parse((ROOT / rel).read_text())
        names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        names |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert "torch" not in names, rel


def test_no_module_over_500_lines():
    sizes = {m: p.read_text().count("\n") for m, p in MODULES.items()}
    big = sorted(((n, m) for m, n in sizes.items() if n > MAX_MODULE_LINES), reverse=True)
    assert not big, "modules over 500 lines: " + ", ".join(f"{m} ({n})" for n, m in big)


def _wing_imports(source_prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{a} imports {b}" for a, deps in sorted(GRAPH.items())
            if a == source_prefix or a.startswith(source_prefix + ".")
            for b in sorted(deps) if any(b == f or b.startswith(f + ".") for f in forbidden)]


def test_cache_wing_imports_no_other_wing():
    """``cluster.cache`` is the Ray cache service; the vLLM integration, the CLI, the workloads
    and the benchmarks build on it, never the other way round."""
    other = tuple(w for w in CLUSTER_WINGS if w != "cluster.cache")
    bad = _wing_imports("cluster.cache", other)
    assert not bad, "\n".join(bad)


def test_benchmarks_import_no_cli_command():
    """``kvblend bench`` runs through the CLI, but the benchmarks themselves call the product's
    modules, never a CLI command's (``cluster.cli.*``)."""
    bad = _wing_imports("cluster.bench", ("cluster.cli",))
    assert not bad, "\n".join(bad)


def test_vllm_wing_imports_only_the_cache_wing():
    """``cluster.vllm`` builds on ``cluster.cache``; the workloads, the CLI and the benchmarks
    build on it (README: Architecture)."""
    bad = _wing_imports("cluster.vllm", ("cluster.workloads", "cluster.cli", "cluster.bench"))
    assert not bad, "\n".join(bad)


def test_workloads_import_no_cli_or_benchmark():
    bad = _wing_imports("cluster.workloads", ("cluster.cli", "cluster.bench"))
    assert not bad, "\n".join(bad)


def test_tiers_tests_import_nothing_from_cluster():
    """``tiers`` is tested on its own: its tests take services from fixtures, not from ``cluster``."""
    bad = []
    for path in sorted((ROOT / "tests" / "tiers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                    if n == "cluster" or n.startswith("cluster.")]
    assert not bad, "\n".join(bad)


def test_cluster_connector_exposes_the_connector_vllm_configs_name():
    """``kv_connector_module_path: cluster.connector`` + ``kv_connector: KVBlendConnector``
    (README, Helm chart, users' configs) loads the connector class itself, and the plugin
    registers the short name under that module path."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from cluster.vllm import connector, plugin

    shim = importlib.import_module("cluster.connector")
    assert issubclass(shim.KVBlendConnector, KVConnectorBase_V1)
    assert shim.KVBlendConnector is connector.KVBlendConnector
    assert shim.KVBlendConnectorMetadata is connector.KVBlendConnectorMetadata
    assert (plugin.CONNECTOR_NAME, plugin.CONNECTOR_MODULE) == ("KVBlendConnector", "cluster.connector")


def _entry_points() -> list[tuple[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    points = [(f"script {name}", target) for name, target in project["scripts"].items()]
    points += [(f"vllm.general_plugins {name}", target)
               for name, target in project["entry-points"]["vllm.general_plugins"].items()]
    return points


def test_pyproject_names_the_kvblend_script_and_the_vllm_plugin():
    names = {name for name, _ in _entry_points()}
    assert {"script kvblend", "vllm.general_plugins kvblend"} <= names, names


@pytest.mark.parametrize("name,target", _entry_points())
def test_entry_point_resolves_to_a_callable(name, target):
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    assert callable(obj), f"{name} = {target!r} is not callable"
