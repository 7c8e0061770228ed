"""serve tunes the garbage collector once the engine is up; embedded workers leave it alone."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from worker import build


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_serving_freezes_the_heap_and_lets_young_objects_die_young(restored_gc: None) -> None:
    _, older, oldest = gc.get_threshold()
    survivor = [object()]  # alive at start-up, like the engine's objects

    build.tune_gc_for_serving()

    assert gc.get_freeze_count() > 0
    # Frozen: in no generation the collector scans.
    assert all(o is not survivor for g in range(3) for o in gc.get_objects(generation=g))
    assert gc.get_threshold() == (build.GC_YOUNG_THRESHOLD, older, oldest)
