"""`extproc serve` freezes its start-up heap once serving (extproc.service.main): a full
garbage collection then no longer walks the ~110,000 objects of modules, policy and gRPC with
the event loop stopped. A Service started inside another program (these tests) leaves that
program's collector alone unless asked."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.service.main import ServeOptions, Service
from tests.conftest import policy_yaml


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Whatever a test froze is thawed afterwards (pytest's own heap among it)."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def _served_freeze_count(tmp_path: Path, freeze_heap: bool) -> tuple[int, int]:
    """Objects frozen, and objects the collector still walks, once the service serves."""
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml())
    options = ServeOptions(policy=str(path), grpc="127.0.0.1:0", admin="127.0.0.1:0")
    service = Service(options, freeze_heap=freeze_heap)
    task = asyncio.create_task(service.run())
    try:

        async def serving() -> None:
            while not service.admin.serving:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(serving(), 10)
        return gc.get_freeze_count(), len(gc.get_objects())
    finally:
        service.request_stop()
        assert await asyncio.wait_for(task, 10) == 0


async def test_serve_freezes_the_startup_heap(tmp_path: Path, unfrozen: None) -> None:
    frozen, walked = await _served_freeze_count(tmp_path, freeze_heap=True)
    assert frozen > 10_000  # modules, policy, gRPC: the whole start-up heap
    assert walked < frozen / 10  # a full collection walks only what came after


async def test_a_service_inside_another_program_freezes_nothing(
    tmp_path: Path, unfrozen: None
) -> None:
    frozen, walked = await _served_freeze_count(tmp_path, freeze_heap=False)
    assert frozen == 0 and walked > 10_000
