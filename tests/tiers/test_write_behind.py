"""WriteBehind (tiers/write_behind.py): bounded background writes, readable while pending, and a
delete that no write or read brings back."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.factories import make_key
from tiers import write_behind
from tiers.write_behind import WriteBehind

pytestmark = pytest.mark.unit


class _Lower:
    """A lower tier whose writes wait for ``release``; records writes and undos."""

    def __init__(self) -> None:
        self.release, self.started = threading.Event(), threading.Event()
        self.stored: set = set()
        self.drops: list = []

    def write(self, key, obj, header) -> None:
        self.started.set()
        assert self.release.wait(10)
        self.stored.add(key)

    def undo(self, key) -> None:
        self.stored.discard(key)


def _behind(low: _Lower, workers: int = 1) -> WriteBehind:
    return WriteBehind(low.write, lambda *a: low.drops.append(a), low.undo, workers=workers)


def test_pending_writes_are_held_until_they_land_and_bounded():
    low = _Lower()
    wb = _behind(low)
    try:
        obj = np.arange(64, dtype=np.uint8)
        keys = [make_key(i) for i in range(3)]
        assert all(wb.submit(k, obj, ("header", i)) for i, k in enumerate(keys))
        assert wb.submit(keys[0], obj, None)  # already pending: the same write
        assert wb.held(keys[1])[1] == ("header", 1) and wb.held(keys[1])[0] is obj  # not a copy
        assert len(wb) == 3 and not wb.drain(0.05)
        low.release.set()
        assert wb.drain(10) and len(wb) == 0 and wb.held(keys[0]) is None
        assert low.stored == set(keys)
    finally:
        low.release.set()
        wb.close()


def test_past_the_bound_a_write_is_dropped(monkeypatch):
    monkeypatch.setattr(write_behind, "MAX_PENDING_WRITES", 2)
    low = _Lower()
    wb = _behind(low)
    try:
        obj = np.zeros(8, np.uint8)
        assert [wb.submit(make_key(i), obj, None) for i in range(4)] == [True, True, False, False]
        assert [d[2] for d in low.drops] == [True, False]  # (pending, bytes, first)
        assert wb.held(make_key(3)) is None
    finally:
        low.release.set()
        wb.close()


def test_a_deleted_chunk_is_not_written_nor_left_behind_by_a_running_write():
    low = _Lower()
    wb = _behind(low)  # one thread: the first write runs, the second waits
    try:
        obj = np.zeros(8, np.uint8)
        running, queued = make_key(0), make_key(1)
        wb.submit(running, obj, None)
        wb.submit(queued, obj, None)
        assert low.started.wait(10)
        wb.forget([running, queued])  # the owner deletes from its tiers after this
        assert wb.held(running) is None and wb.held(queued) is None
        low.release.set()
        assert wb.drain(10)
        assert low.stored == set()  # the running one landed and was undone; the queued one never ran
    finally:
        low.release.set()
        wb.close()


def test_a_put_back_never_runs_beside_a_delete():
    low = _Lower()
    wb = _behind(low)
    try:
        key = make_key(0)
        wb.submit(key, np.zeros(8, np.uint8), "h")
        top: set = set()
        inside, go_on = threading.Event(), threading.Event()

        def put(obj, header):  # the owner's put into its top tier, slow
            inside.set()
            assert go_on.wait(10)
            top.add(key)
            return True

        restorer = threading.Thread(target=lambda: wb.restore(key, put))
        restorer.start()
        assert inside.wait(10)
        deleter = threading.Thread(target=lambda: (wb.forget([key]), top.discard(key)))
        deleter.start()
        deleter.join(0.2)
        assert deleter.is_alive()  # forget waits for the put back under way
        go_on.set()
        restorer.join(10)
        deleter.join(10)
        assert top == set() and wb.held(key) is None  # then the delete removed it
        assert wb.restore(key, put) is False  # nothing to put back any more
    finally:
        low.release.set()
        wb.close()


def test_after_close_nothing_is_taken_or_held():
    low = _Lower()
    wb = _behind(low)
    wb.close()
    with pytest.raises(RuntimeError):  # as a closed executor: the caller's mistake
        wb.submit(make_key(0), np.zeros(8, np.uint8), None)
    assert wb.held(make_key(0)) is None and len(wb) == 0
