"""kvserve/workers/core/gc_pauses.py: the start-up heap frozen out of the collector's scans (and the switch
that keeps it), every collection timed, a long one logged."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator

import pytest

from kvserve.workers.core import gc_pauses
from kvserve.workers.core.gc_pauses import FREEZE_ENV, GcPauses, freeze_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The test process's heap is not ours to keep frozen: thaw it after each test."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freeze_exempts_what_exists_from_collection_and_leaves_later_garbage_collectable(unfrozen) -> None:  # noqa: ANN001
    # Weak references, not gc.collect()'s count or an exact freeze count: other threads of the test
    # process (a server a previous test left stopping) may make garbage or freeze their own heap meanwhile.
    before = _Node()
    before_ref = weakref.ref(before)
    # NOTE: no comparison with gc.get_freeze_count() later: a frozen object freed by its refcount leaves the
    # count (it fell by 3 between two reads in a full run)
    assert freeze_heap("test") > 0
    del before
    gc.collect()
    assert before_ref() is not None, "the frozen cycle is not walked, so not freed"
    later = _Node()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None, "what was made after the freeze is collected as before"


def test_the_switch_keeps_the_heap_unfrozen(unfrozen, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(FREEZE_ENV, "0")
    assert freeze_heap("test") == 0
    assert gc.get_freeze_count() == 0


def test_every_collection_is_timed_by_generation_and_observed(monkeypatch) -> None:  # noqa: ANN001
    seen: list[tuple[int, float]] = []
    pauses = GcPauses("test", lambda generation, seconds: seen.append((generation, seconds)))
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.close()
    assert [g for g, _ in seen] == [0, 2]
    assert all(s >= 0 for _, s in seen)
    assert pauses.collections[0] == 1 and pauses.collections[2] == 1
    assert pauses.seconds[2] == seen[1][1] and pauses.longest_s == max(s for _, s in seen)
    gc.collect(0)
    assert len(seen) == 2, "closed: no longer hooked"


def test_a_long_pause_is_logged(monkeypatch, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(gc_pauses, "SLOW_PAUSE_S", 0.0)
    pauses = GcPauses("router")
    try:
        with caplog.at_level(logging.WARNING, logger=gc_pauses.__name__):
            gc.collect(1)
    finally:
        pauses.close()
    assert any("router: a generation-1 garbage collection paused" in r.getMessage() for r in caplog.records)
