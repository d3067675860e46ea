"""The demo's workload (:func:`cluster.workloads.demo.build_workload`): what the issue fixes
(issue 36: 16 queries x 6 passages, one in six never ingested, queries overlapping) and a
short warm-up whose passages are all ingested."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.workloads.demo import WARMUP_PASSAGES, build_workload

pytestmark = pytest.mark.unit


def _examples(n: int, k: int = 10) -> list:
    return [SimpleNamespace(id=f"ex{i}", question=f"q{i}?", answers=(f"a{i}",),
                            passages=tuple(f"passage {i}.{j}" for j in range(k))) for i in range(n)]


def test_the_demo_workload_has_the_issues_shape():
    w = build_workload(_examples(17), num_queries=16, k=6, holdout=0.2, seed=0)
    assert len(w.queries) == 16 and all(len(set(q.passages)) == 6 for q in w.queries)
    ingested, held = set(w.ingest), set(w.held_out)
    assert not ingested & held and len(w.ingest) == len(ingested)
    for i, q in enumerate(w.queries):
        assert sum(p in held for p in q.passages) == 1  # one passage in six is a miss
        assert f"passage {(i + 1) % 16}.0" in q.passages  # shared with the next query
    hits = sum(p in ingested for q in w.queries for p in q.passages)
    assert hits / (16 * 6) == pytest.approx(5 / 6)


def test_the_warm_up_is_short_and_takes_the_blend_path():
    w = build_workload(_examples(17), num_queries=16, k=6, holdout=0.2, seed=0)
    (warm,) = w.warmup
    assert len(warm.passages) == WARMUP_PASSAGES < 6
    assert set(warm.passages) <= set(w.ingest)  # every warm-up passage is a hit
    assert not set(warm.passages) & {p for q in w.queries for p in q.passages}


def test_the_workload_is_deterministic_and_needs_one_example_for_the_warm_up():
    a = build_workload(_examples(17), num_queries=16, k=6, holdout=0.2, seed=3)
    b = build_workload(_examples(17), num_queries=16, k=6, holdout=0.2, seed=3)
    assert a == b
    with pytest.raises(ValueError, match="need 17"):
        build_workload(_examples(16), num_queries=16, k=6, holdout=0.2, seed=0)
