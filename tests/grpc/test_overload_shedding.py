"""The service falling behind itself (its event loop lagged by a CPU-burning coroutine): the
tenant above its fair share is shed with 429 + Retry-After, new and queued requests alike,
while the light tenant is still admitted; shedding stops once the loop catches up."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from extproc.policy import hash_key, policy_from_text
from extproc.service import request as request_record
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.status.readings import counter_totals
from tests.conftest import TEST_KEYS
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, chat_body, headers_message
from tests.grpc_support import served_stub

POLICY = f"""\
version: 1
tiers: [standard]
tenants:
  globex: {{tier: standard, api_keys: ["{hash_key(TEST_KEYS["globex"])}"]}}
  initech: {{tier: standard, api_keys: ["{hash_key(TEST_KEYS["initech"])}"]}}
pools:
  short:
    max_total_tokens: 2048
    max_inflight: 6
    headroom: 2
    max_inflight_tokens: 400000
    endpoints: ["127.0.0.1:1"]
    adaptive: {{enabled: false}}
gateway:
  reconcile_cut_short: false
  overload: {{lag_threshold_ms: 30, interval_ms: 10, recover_ms: 300}}
"""

BURN_SLICE_S = 0.05
"""Each turn of the burner holds the event loop this long: every wake-up is that late."""


@pytest.fixture
async def service() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    gateway = compose(policy_from_text(POLICY))
    await gateway.start()
    async with served_stub(gateway, close_gateway=True) as stub:
        yield gateway, stub


@contextlib.asynccontextmanager
async def burning_loop() -> AsyncIterator[None]:
    """A coroutine that keeps the event loop busy (CPU, not sleeping) in slices."""
    running = True

    async def burn() -> None:
        while running:
            end = time.perf_counter() + BURN_SLICE_S
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(0)

    task = asyncio.create_task(burn())
    try:
        yield
    finally:
        running = False
        await task


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout)


async def start_request(stub: ext_proc_grpc.ExternalProcessorStub, tenant: str) -> EnvoyPeer:
    peer = EnvoyPeer(stub)
    reply = await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS[tenant]))
    assert reply.WhichOneof("response") == "request_headers"
    return peer


async def body_reply(peer: EnvoyPeer) -> ProcessingResponse:
    return await peer.send(body_message(chat_body("hello", 16)))


async def fill_the_soft_limit(
    stub: ext_proc_grpc.ExternalProcessorStub, peers: list[EnvoyPeer], queue: int
) -> list[EnvoyPeer]:
    """globex 1 and initech 3 in flight fill the soft limit (4 of 6); initech queues `queue`
    more, whose streams are returned. Every stream opened goes to `peers` (closed by the
    caller)."""
    for tenant in ("globex", "initech", "initech", "initech"):
        peer = await start_request(stub, tenant)
        peers.append(peer)
        assert (await body_reply(peer)).WhichOneof("response") == "request_body"
    queued = []
    for _ in range(queue):
        peer = await start_request(stub, "initech")
        peers.append(peer)
        assert (await body_reply(peer)).HasField("override_message_timeout")
        queued.append(peer)
    return queued


def assert_shed(reply: ProcessingResponse) -> None:
    assert reply.WhichOneof("response") == "immediate_response"
    answer = reply.immediate_response
    assert answer.status.code == 429
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    assert int(headers["retry-after"]) >= 1
    error = orjson.loads(answer.body)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "shed_overload"
    assert "overloaded" in error["message"]


def shed_count(gateway: Gateway) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "extproc_shed_total", {"reason": "lag", "tier": "standard"}
    )
    return value or 0.0


def requests_by_outcome(gateway: Gateway, tenant: str) -> dict[str, float]:
    totals = counter_totals(gateway.metrics.requests, ("tenant", "outcome"))
    return {outcome: n for (name, outcome), n in totals.items() if name == tenant}


async def test_lagging_loop_sheds_the_heavy_tenant_and_admits_the_light_one(
    service, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    # The admitted requests stay in flight: the admission stream ends at the forward, and
    # Envoy would attach each one's accounting stream then; this test plays the admission
    # streams only, so the attach grace holds their capacity instead, for the whole test.
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 300.0)
    peers: list[EnvoyPeer] = []
    try:
        queued = await fill_the_soft_limit(stub, peers, queue=2)
        assert gateway.scheduler.queued() == 2
        assert gateway.overload.reason is None

        async with burning_loop():
            await until(lambda: gateway.overload.reason == "lag")
            assert gateway.overload.shed_set == {"initech"}
            for peer in queued:  # the held requests are answered, not left to time out
                assert_shed(await peer.read())
            assert gateway.scheduler.queued() == 0

            shed = await start_request(stub, "initech")
            peers.append(shed)
            assert_shed(await body_reply(shed))

            light = await start_request(stub, "globex")
            peers.append(light)
            admitted = await body_reply(light)
            assert admitted.WhichOneof("response") == "request_body"
            values = {
                h.header.key: h.header.raw_value.decode()
                for h in admitted.request_body.response.header_mutation.set_headers
            }
            assert values["x-tenant-id"] == "globex"
            assert gateway.overload.reason == "lag"  # still shedding when globex got in
        assert shed_count(gateway) == 3
        # Its own outcome, apart from the deadline's `shed` (503).
        assert requests_by_outcome(gateway, "initech").get("shed_overload") == 3
        assert "shed" not in requests_by_outcome(gateway, "initech")
        assert gateway.metrics.registry.get_sample_value("extproc_overload_shedding") == 1

        await until(lambda: gateway.overload.reason is None)
        again = await start_request(stub, "initech")
        peers.append(again)
        # Caught up: initech is queued again (the soft limit is full), not shed.
        assert (await body_reply(again)).HasField("override_message_timeout")
        assert shed_count(gateway) == 3
    finally:
        for peer in peers:
            await peer.close()


@pytest.fixture
async def tracked_service() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    """Served as `extproc serve` does: the server reports each admission stream it opens."""
    gateway = compose(policy_from_text(POLICY))
    await gateway.start()
    async with served_stub(gateway, close_gateway=True, tracked=True) as stub:
        yield gateway, stub


async def samples_stay_short(gateway: Gateway, samples: int = 3) -> None:
    monitor = gateway.lag_monitor
    for _ in range(samples):
        due = monitor.next_sample_at
        await until(lambda: monitor.next_sample_at != due)  # noqa: B023
        assert not monitor.idle


async def test_the_monitor_idles_until_a_stream_opens_and_stays_short_while_work_is_held(
    tracked_service, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = tracked_service
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 300.0)
    monitor = gateway.lag_monitor
    await until(lambda: monitor.idle)  # nothing open, queued or in flight
    peer = await start_request(stub, "globex")
    try:
        assert not monitor.idle  # the stream's headers woke it before they were answered
        # Now Envoy waits on the client's body, not on us: the monitor may idle until the
        # body comes (which wakes it, as a new stream does).
        assert (await body_reply(peer)).WhichOneof("response") == "request_body"
        assert gateway.scheduler.inflight() == 1
        # Forwarded, the request holds its capacity until its accounting stream ends: each
        # sample after the answer keeps the short interval.
        await samples_stay_short(gateway)
    finally:
        await peer.close()


async def test_a_submitted_request_wakes_the_monitor_whoever_serves_the_streams(
    service, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service  # a server that does not report the streams it opens
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 300.0)
    monitor = gateway.lag_monitor
    await until(lambda: monitor.idle)
    peer = await start_request(stub, "globex")
    try:
        assert (await body_reply(peer)).WhichOneof("response") == "request_body"
        assert not monitor.idle
        await samples_stay_short(gateway)
    finally:
        await peer.close()
