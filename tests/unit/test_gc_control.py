"""peagle_train.core.gc_control: the automatic collector off during training, young generations collected
every ``train.gc_every`` steps, full collections only where the caller says (between steps)."""
from __future__ import annotations

import gc

import pytest

from peagle_train.core.gc_control import FULL_EVERY, full_collection, manual_collection, young_collection


@pytest.fixture
def generations():
    seen = []

    def cb(phase, info):
        if phase == "stop":
            seen.append(info["generation"])

    gc.callbacks.append(cb)
    yield seen
    gc.callbacks.remove(cb)


def test_manual_collection_turns_the_collector_off_and_back(generations):
    assert gc.isenabled()
    with manual_collection(None):  # None: Python's own collector, untouched
        assert gc.isenabled() and gc.get_freeze_count() == 0
    with manual_collection(5):
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # what was alive at entry is frozen
        assert generations == [2]  # one full collection on entry
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_young_and_full_collections_at_their_steps(generations):
    assert not young_collection(4, 2)  # automatic collector on: nothing to do
    with manual_collection(2):
        generations.clear()
        ran = [young_collection(step, 2) for step in range(1, 7)]
        assert ran == [False, True, False, True, False, True] and generations == [1, 1, 1]
        generations.clear()
        assert not full_collection(FULL_EVERY * 2 - 1, 2) and generations == []
        assert full_collection(FULL_EVERY * 2, 2) and full_collection(None, 2) and generations == [2, 2]
    assert not full_collection(None, 2)
