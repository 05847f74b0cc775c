"""The long-running processes freeze their start-up heap once serving (extproc.heap): `extproc
serve`, its accounting child and the emulated engine (as vLLM's engine core does). A full
garbage collection then no longer walks the modules, policy and gRPC objects with the event
loop stopped. A Service started inside another program (these tests) leaves that program's
collector alone unless asked."""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.service.accounting_link import READY, FrameReader
from extproc.service.accounting_process import _serve_child
from extproc.service.main import ServeOptions, Service
from gateway_lab.engine import cli as engine_cli
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


async def test_the_emulated_engine_freezes_once_it_listens(unfrozen: None) -> None:
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    server = engine_cli.build_server(parser.parse_args(["--port", "0", "--profile", "fast"]))
    stop = asyncio.Event()
    task = asyncio.create_task(engine_cli._serve(server, stop))
    try:

        async def listening() -> None:
            while server._port is None:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(listening(), 10)
        assert gc.get_freeze_count() > 10_000
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_the_accounting_child_freezes_once_it_serves(unfrozen: None) -> None:
    parent, child = socket.socketpair()
    parent.setblocking(False)
    task = asyncio.create_task(_serve_child("127.0.0.1:0", child.detach()))
    try:
        reader, frames = FrameReader(), []
        loop = asyncio.get_running_loop()
        while not any(event[0] == READY for frame in frames for event in frame):
            data = await asyncio.wait_for(loop.sock_recv(parent, 65536), 10)
            assert data, "the child closed the link before it served"
            frames += reader.feed(data)
        assert gc.get_freeze_count() > 10_000
    finally:
        parent.close()  # the child stops serving when its link closes
        await asyncio.wait_for(task, 10)
