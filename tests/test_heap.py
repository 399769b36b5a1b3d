"""The collector settings every Keel process applies once it has started."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from services.common.heap import THRESHOLDS, settle_heap


@pytest.fixture
def restored_collector() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_collector")
def test_start_up_objects_leave_every_later_collection() -> None:
    assert gc.get_freeze_count() == 0
    settle_heap()
    # Modules, classes and everything else imported so far are frozen: a full
    # collection no longer walks them.
    assert gc.get_freeze_count() > 10_000
    assert gc.get_threshold() == THRESHOLDS
