"""The service's cores oversubscribed (two busy processes on the CPU its event loop runs on),
its loop on time by the lag's measure: with `cpu_wait_fraction` set the tenant above its fair
share is shed with 429 + Retry-After, queued and new, while the light tenant is admitted."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from extproc.policy import policy_from_text
from extproc.service import request as request_record
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from tests.grpc.test_extproc_stream import EnvoyPeer
from tests.grpc.test_overload_shedding import (
    POLICY,
    assert_shed,
    body_reply,
    fill_the_soft_limit,
    start_request,
    until,
)
from tests.grpc_support import served_stub
from tests.spinners import spinners

CPU_WAIT_POLICY = POLICY.replace(
    "overload: {lag_threshold_ms: 30, interval_ms: 10, recover_ms: 300}",
    "overload: {lag_threshold_ms: 60000, interval_ms: 10, recover_ms: 300,\n"
    "             cpu_wait_fraction: 0.3}",
)


@pytest.fixture
async def service() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    assert CPU_WAIT_POLICY != POLICY
    gateway = compose(policy_from_text(CPU_WAIT_POLICY))
    await gateway.start()
    async with served_stub(gateway, close_gateway=True) as stub:
        yield gateway, stub


@pytest.fixture
def crowded_cpu() -> Iterator[Callable[[], None]]:
    """Calling it pins this thread (the event loop's) to one CPU and starts two busy processes
    there; both undone at the end."""
    allowed = os.sched_getaffinity(0)
    with contextlib.ExitStack() as stack:

        def crowd() -> None:
            cpu = min(allowed)
            os.sched_setaffinity(0, {cpu})  # 0: the calling thread only
            stack.callback(os.sched_setaffinity, 0, allowed)
            stack.enter_context(spinners(2, cpu=cpu))

        yield crowd


async def test_waiting_for_a_cpu_sheds_the_heavy_tenant_and_admits_the_light_one(
    service, crowded_cpu, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 300.0)  # see test_overload_shedding
    peers: list[EnvoyPeer] = []
    try:
        (queued,) = await fill_the_soft_limit(stub, peers, queue=1)
        assert gateway.overload.reason is None

        crowded_cpu()
        await until(lambda: gateway.overload.reason == "cpu_wait", timeout=20.0)
        assert gateway.overload.shed_set == {"initech"}
        wait = gateway.metrics.registry.get_sample_value("extproc_event_loop_cpu_wait_ratio")
        assert wait is not None and wait > 0.3
        assert_shed(await queued.read())
        shed = await start_request(stub, "initech")
        peers.append(shed)
        assert_shed(await body_reply(shed))
        light = await start_request(stub, "globex")
        peers.append(light)
        assert (await body_reply(light)).WhichOneof("response") == "request_body"
        shed_total = gateway.metrics.registry.get_sample_value(
            "extproc_shed_total", {"reason": "cpu_wait", "tier": "standard"}
        )
        assert shed_total is not None and shed_total >= 2
    finally:
        for peer in peers:
            await peer.close()
