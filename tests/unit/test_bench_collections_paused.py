"""The load generator runs no automatic full garbage collection while a load is open
(gateway_lab.bench.loadgen.FullCollectionsPaused): a full collection of its growing heap
stopped the benchmark's client for up to ~190 ms, timed as the gateway's latency."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest

from gateway_lab.bench.loadgen import FullCollectionsPaused, Load
from gateway_lab.bench.records import Meter


@pytest.fixture
def full_collections() -> Iterator[Callable[[], int]]:
    """How many full collections the collector has run on its own since the fixture began."""
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            seen.append(1)

    gc.collect()
    gc.callbacks.append(count)
    try:
        yield lambda: len(seen)
    finally:
        gc.callbacks.remove(count)


def _grow_heap(objects: int) -> list[list[int]]:
    """Long-lived containers, the way a load generator's records pile up."""
    return [[i] for i in range(objects)]


def test_a_growing_heap_triggers_full_collections_unless_paused(
    full_collections: Callable[[], int],
) -> None:
    growth = max(300_000, len(gc.get_objects()))  # past the collector's 25% growth rule
    kept = _grow_heap(growth)
    unpaused = full_collections()
    with FullCollectionsPaused():
        entered = full_collections()  # the one collection on entering
        kept += _grow_heap(growth)
        assert full_collections() == entered
    assert unpaused >= 1
    assert full_collections() == entered + 1  # and one on leaving, outside the timed part
    del kept


def test_holders_nest_and_the_threshold_comes_back() -> None:
    before = gc.get_threshold()
    with FullCollectionsPaused():
        with FullCollectionsPaused():
            assert gc.get_threshold()[2] > 1_000_000
        assert gc.get_threshold()[2] > 1_000_000  # the outer holder still holds
    assert gc.get_threshold() == before


async def test_an_open_load_holds_the_pause() -> None:
    before = gc.get_threshold()
    async with Load("http://127.0.0.1:9/v1/completions", Meter(bin_s=1.0)):
        assert gc.get_threshold()[:2] == before[:2]
        assert gc.get_threshold()[2] > 1_000_000
    assert gc.get_threshold() == before
