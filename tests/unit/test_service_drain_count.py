"""What the drain reports as cut: the requests in flight when the grace ran out.

The gRPC server's stop cancels the calls still running at the end of the grace and only then
completes, once their handlers have released their leases. A count taken while it completes
saw 0 and logged "drained" after cutting a response (a flaky process-level test under load).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import pytest

from extproc.service.main import ServeOptions, Service


@dataclass
class _Scheduler:
    leases: int

    def snapshot(self) -> dict[str, int]:
        return {"queued": 0, "leases": self.leases}

    def inflight(self) -> int:
        return self.leases


@dataclass
class _Gateway:
    scheduler: _Scheduler
    closing: bool = False
    refused_closing: int = 0

    def drain_queued(self, retry_after_s: int) -> int:
        return 0


@dataclass
class _SlowStoppingServer:
    """Like grpc.aio's stop(grace): wait out the grace, cancel the running calls (their
    handlers release the leases at once), then take a while to complete."""

    scheduler: _Scheduler
    finish_early: bool = False
    after_cancel_s: float = 0.3

    async def stop(self, grace: float | None) -> None:
        if self.finish_early:
            self.scheduler.leases = 0
            return
        await asyncio.sleep(grace or 0.0)
        self.scheduler.leases = 0
        await asyncio.sleep(self.after_cancel_s)


def _service(grace: float, server: _SlowStoppingServer) -> Service:
    service = Service(ServeOptions(policy="unused.yaml", drain_grace=grace))
    service.gateway = _Gateway(server.scheduler)  # type: ignore[assignment]
    service.server = server  # type: ignore[assignment]
    return service


async def test_a_request_cut_by_the_grace_is_counted_even_though_stop_completes_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = _SlowStoppingServer(_Scheduler(leases=1))
    with caplog.at_level(logging.INFO, logger="extproc.serve"):
        caplog.clear()
        await asyncio.wait_for(_service(0.1, server).drain(), 10)
    messages = [r.getMessage() for r in caplog.records]
    assert "drain grace over; in-flight requests were cut" in messages, messages
    cut = next(r for r in caplog.records if r.getMessage().startswith("drain grace over"))
    assert cut.fields == {"drained_queued": 0, "inflight_cut": 1}  # type: ignore[attr-defined]


async def test_responses_that_end_within_the_grace_are_not_reported_cut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = _SlowStoppingServer(_Scheduler(leases=1), finish_early=True)
    with caplog.at_level(logging.INFO, logger="extproc.serve"):
        caplog.clear()
        await asyncio.wait_for(_service(0.1, server).drain(), 10)
    drained = next(r for r in caplog.records if r.getMessage() == "drained")
    assert drained.fields == {"drained_queued": 0, "inflight_cut": 0}  # type: ignore[attr-defined]
