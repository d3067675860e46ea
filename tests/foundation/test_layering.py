"""Imports go one way: cluster -> blend -> tiers (an import-linter contract, as a test)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = {"tiers": {"blend", "cluster"}, "blend": {"cluster"}}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_imports_go_one_way():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            hit = _imports(path) & forbidden
            if hit:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hit)}")
    assert not bad, "layering violated: " + "; ".join(bad)


def test_bookkeeping_modules_do_not_import_torch():
    for rel in ("tiers/keys.py", "tiers/format.py", "tiers/tier.py", "blend/plan.py"):
        assert "torch" not in _imports(ROOT / rel), rel
