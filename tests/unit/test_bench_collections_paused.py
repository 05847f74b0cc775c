"""The load generator runs no automatic garbage collection while a load is open
(gateway_lab.bench.loadgen.CollectorPaused): a full collection of its growing heap stopped
the benchmark's client for up to ~190 ms, and a young one for up to 15 ms of CPU, timed as the
gateway's latency."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest

from gateway_lab.bench.loadgen import CollectorPaused, Load
from gateway_lab.bench.records import Meter


@pytest.fixture
def collections() -> Iterator[Callable[[], int]]:
    """How many collections (any generation) have run since the fixture began."""
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        del info
        if phase == "stop":
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


def test_a_growing_heap_is_collected_unless_paused(collections: Callable[[], int]) -> None:
    kept = _grow_heap(100_000)
    unpaused = collections()
    with CollectorPaused():
        entered = collections()  # the one collection on entering
        kept += _grow_heap(100_000)
        assert collections() == entered
    assert unpaused >= 100  # a young collection every ~700 new objects
    assert collections() == entered + 1  # and one on leaving, outside the timed part
    del kept


def test_holders_nest_and_the_collector_comes_back() -> None:
    assert gc.isenabled()
    with CollectorPaused():
        with CollectorPaused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer holder still holds
    assert gc.isenabled()


async def test_an_open_load_holds_the_pause() -> None:
    async with Load("http://127.0.0.1:9/v1/completions", Meter(bin_s=1.0)):
        assert not gc.isenabled()
    assert gc.isenabled()
