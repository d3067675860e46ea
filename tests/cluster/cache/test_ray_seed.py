"""Joining Ray from seeded processes (vLLM seeds ``random`` identically in every worker)."""

from __future__ import annotations

import random

import pytest

from cluster.cache.connect import _unseeded_random

pytestmark = pytest.mark.unit


def test_ray_init_draws_fresh_ids_in_identically_seeded_processes():
    """Ray draws pubsub subscriber ids from ``random``: two workers seeded alike must still
    get different ids, or their GCS polls cancel each other in a busy loop."""
    ids = []
    for _ in range(2):  # two "workers", both seeded 0 as vLLM does
        random.seed(0)
        with _unseeded_random():
            ids.append(bytes(random.getrandbits(8) for _ in range(28)))
    assert ids[0] != ids[1]


def test_the_callers_random_sequence_is_left_as_it_was():
    random.seed(1234)
    expected = [random.random() for _ in range(3)]
    random.seed(1234)
    with _unseeded_random():
        random.random()
    assert [random.random() for _ in range(3)] == expected
