"""tests/gpu: kernel, ops and staging tests; CUDA-only ones carry ``@pytest.mark.gpu``.

The root conftest skips items whose *keywords* contain ``gpu`` when there is no CUDA, and a
test's keywords include its directory's name; this hook (run after it) lifts that skip from
the CPU tests of this directory, which have no ``gpu`` marker.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" not in item.nodeid.replace("\\", "/") or item.get_closest_marker("gpu") is not None:
            continue
        item.own_markers[:] = [m for m in item.own_markers
                               if not (m.name == "skip" and m.kwargs.get("reason") == "needs a CUDA GPU")]
