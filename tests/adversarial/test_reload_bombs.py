"""Hostile policy files reach the reloader: each is refused with file:line, the last good
policy stays, and the event loop keeps running while the file is read."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from extproc.policy import load_policy
from extproc.reload import PolicyReloader
from extproc.service.composition import compose
from tests.adversarial.yaml_bombs import BOMBS
from tests.conftest import policy_yaml


async def longest_stall(until: asyncio.Future[object], tick_s: float = 0.01) -> float:
    """The longest the loop went without running this coroutine, until `until` is done."""
    worst = 0.0
    last = time.monotonic()
    while not until.done():
        await asyncio.sleep(tick_s)
        now = time.monotonic()
        worst = max(worst, now - last - tick_s)
        last = now
    return worst


async def settled(reloader: PolicyReloader, result: str) -> None:
    while reloader.last_result is None or reloader.last_result.result != result:
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(("name", "text", "line", "message"), BOMBS, ids=[b[0] for b in BOMBS])
async def test_bomb_is_refused_off_the_loop(
    tmp_path: Path, name: str, text: str, line: int, message: str
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml())
    gateway = compose(load_policy(path))
    reloader = PolicyReloader(str(path), gateway.apply_policy, gateway.metrics, interval_s=0)
    reloader.mark_loaded(path.read_text())
    before = gateway.policy
    path.write_text(text)
    reload = asyncio.ensure_future(reloader.reload_async("test"))
    stall = await asyncio.wait_for(longest_stall(reload), 30)
    result = await reload
    assert result.result == "error", name
    assert len(result.errors) == 1
    assert result.errors[0].startswith(f"{path}:{line}: {message}")
    assert gateway.policy is before
    assert stall < 0.5, f"the loop stalled {stall:.2f}s reading {name}"


async def test_the_watcher_refuses_a_bomb_and_keeps_watching(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml())
    gateway = compose(load_policy(path))
    reloader = PolicyReloader(str(path), gateway.apply_policy, gateway.metrics, interval_s=0.05)
    reloader.mark_loaded(path.read_text())
    reloader.start()
    try:
        path.write_text(BOMBS[0][1])
        await asyncio.wait_for(settled(reloader, "error"), 10)
        path.write_text(policy_yaml(globex_limits="{max_queued: 7}"))
        await asyncio.wait_for(settled(reloader, "success"), 10)
        assert gateway.policy.tenants["globex"].limits.max_queued == 7
    finally:
        await reloader.stop()
