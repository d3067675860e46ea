"""The generated config table (docs/configuration.md) is current, the README opens with the two
commands, and the setup script is idempotent."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_config_table_is_current():
    from cluster.cli.docs import CONFIG_DOC, render

    assert CONFIG_DOC == ROOT / "docs" / "configuration.md"  # the file `python -m cluster.cli.docs` rewrites
    text = CONFIG_DOC.read_text()
    assert render(text) == text, "docs/configuration.md's config table is stale: run `python -m cluster.cli.docs`"
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()  # the README links it


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    cmds = [line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert cmds[0] == "bash scripts/setup.sh && .venv/bin/kvblend demo"
    test_cmd = cmds[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci


def test_setup_is_idempotent_and_keeps_transformers_importable():
    venv_python = ROOT / ".venv" / "bin" / "python"
    if pathlib.Path(sys.executable).resolve() != venv_python.resolve():
        import pytest

        pytest.skip("runs only from the project's .venv")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "installing kvblend" not in r.stdout  # the stamp skipped pip
    r = subprocess.run([str(venv_python), "-c", "import transformers, vllm, ray; print('ok')"],
                       capture_output=True, text=True, timeout=300)
    assert r.stdout.strip().endswith("ok"), r.stderr[-2000:]
