"""The `priority` body field over HTTP: validated as vLLM validates it, scheduled by the core."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway_lab.engine.server import EngineServer, running_engine

COMPLETIONS = "/v1/completions"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
        yield client


async def wait_until(engine: EngineServer, running: int, waiting: int) -> None:
    """Bounded poll until the core holds `running` running and `waiting` waiting requests."""
    deadline = time.monotonic() + 5.0
    while (engine.core.num_running, engine.core.num_waiting) != (running, waiting):
        assert time.monotonic() < deadline, "the engine did not reach the expected state"
        await asyncio.sleep(0.002)


async def finish_order(session: aiohttp.ClientSession, policy: str) -> list[str]:
    """One running request, two waiting with priority 5, then one with priority -1."""
    done: list[str] = []
    async with running_engine(
        profile="fast", max_num_seqs=1, step_base_s=0.005, scheduling_policy=policy
    ) as engine:

        async def one(name: str, priority: int, max_tokens: int) -> None:
            body = {"prompt": "hello", "max_tokens": max_tokens, "priority": priority}
            async with session.post(engine.base_url + COMPLETIONS, json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            done.append(name)

        tasks = [asyncio.create_task(one("running", 0, 20))]
        await wait_until(engine, 1, 0)
        tasks += [asyncio.create_task(one(f"low{i}", 5, 3)) for i in range(2)]
        await wait_until(engine, 1, 2)
        tasks.append(asyncio.create_task(one("urgent", -1, 3)))
        await wait_until(engine, 1, 3)
        await asyncio.gather(*tasks)
    return done


async def test_priority_field_orders_the_waiting_queue(session: aiohttp.ClientSession) -> None:
    assert await finish_order(session, "priority") == ["running", "urgent", "low0", "low1"]


async def test_fcfs_engine_accepts_and_ignores_priority(session: aiohttp.ClientSession) -> None:
    assert await finish_order(session, "fcfs") == ["running", "low0", "low1", "urgent"]


@pytest.mark.parametrize(
    ("value", "kind"),
    [("high", "int_parsing"), (1.5, "int_from_float"), (None, "int_type"), (2**63, "less_than")],
)
async def test_non_integer_priority_gets_vllms_validation_error(
    session: aiohttp.ClientSession, value: object, kind: str
) -> None:
    async with running_engine(profile="fast", scheduling_policy="priority") as engine:
        body = {"prompt": "hi", "max_tokens": 1, "priority": value}
        async with session.post(engine.base_url + COMPLETIONS, json=body) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["type"] == "Bad Request" and error["code"] == 400
    assert error["param"] == "body.priority"
    assert error["message"].startswith("1 validation error:\n  {'type': '" + kind)
    assert "'loc': 'body.priority'" in error["message"]


async def test_lax_integer_priorities_are_accepted(session: aiohttp.ClientSession) -> None:
    # pydantic's lax mode, as in vLLM: a numeric string, an integral float and a boolean.
    async with running_engine(profile="fast", scheduling_policy="priority") as engine:
        for value in ("3", 2.0, True, -(2**63)):
            body = {"prompt": "hi", "max_tokens": 1, "priority": value}
            async with session.post(engine.base_url + COMPLETIONS, json=body) as resp:
                assert resp.status == 200, (value, await resp.text())
