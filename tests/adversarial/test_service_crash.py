"""kill -9 of the ext_proc service through the real Envoy, engines alive: responses already
under way complete (streamed or not), held requests get an answer at once, new requests are
refused (never forwarded unadmitted) until the restarted service is ready, then pass."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway_lab.processes import Child, RestartLimits, Supervisor, http_ok
from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.dataplane.test_accounting import scrape
from tests.dataplane.test_admission import settled, tenants_view, wait_for_view

pytestmark = pytest.mark.dataplane

URL_PATH = "/v1/chat/completions"
_LONG = 6_000
"""Output tokens of the streamed response: long enough to be in flight through the crash."""


@pytest.fixture
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    # One request at a time in the long pool: a second one is held at the door.
    def make(short: str, long_: str) -> str:
        return policy_yaml(short, long_, long_inflight=1)

    with running_gateway(tmp_path_factory.mktemp("crash"), make) as running:
        yield running


def chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "keep going"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def service_of(gateway: RunningGateway) -> Child:
    return next(c for c in gateway.stack.children if c.name == "extproc")


def kill_service(gateway: RunningGateway) -> None:
    process = service_of(gateway).process
    assert process is not None
    process.send_signal(signal.SIGKILL)
    process.wait(10)


async def post(
    session: aiohttp.ClientSession, gateway: RunningGateway, body: dict[str, Any]
) -> tuple[int, dict[str, str], bytes]:
    headers = {"authorization": f"Bearer {TEST_KEYS['globex']}"}
    async with session.post(gateway.base_url + URL_PATH, json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


def openai_error(raw: bytes) -> dict[str, Any]:
    error = orjson.loads(raw)["error"]
    assert {"message", "type", "code"} <= set(error)
    return error  # type: ignore[no-any-return]


async def restarted(gateway: RunningGateway) -> None:
    """What `extproc up` does: the supervisor starts the service again; wait until ready."""
    supervisor = Supervisor(gateway.stack, fatal=frozenset({"envoy"}), say=lambda _: None,
                            limits=RestartLimits(backoff_s=0.1))  # fmt: skip
    ready = f"http://{gateway.config.admin}/readyz"
    async with asyncio.timeout(60):
        while not (service_of(gateway).alive() and http_ok(ready, timeout=0.5)):
            assert supervisor.check() is None
            await asyncio.sleep(0.05)


async def test_streams_survive_a_service_crash_and_new_requests_wait_for_its_restart(
    gateway: RunningGateway,
) -> None:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        headers = {"authorization": f"Bearer {TEST_KEYS['globex']}"}
        streaming = await session.post(
            gateway.base_url + URL_PATH, json=chat(_LONG, stream=True), headers=headers
        )
        assert streaming.status == 200
        first = await streaming.content.readline()
        assert first.startswith(b"data: ")
        held = asyncio.ensure_future(post(session, gateway, chat(3000, stream=False)))
        await wait_for_view(session, gateway, lambda view: view["tenants"]["globex"]["queued"] == 1)

        kill_service(gateway)
        killed_at = time.monotonic()
        # The held request is answered at once, with an error, not forwarded.
        status, _, raw = await held
        assert status >= 500 and time.monotonic() - killed_at < 5, (status, raw)
        # A new request during the outage is refused too.
        status, _, raw = await post(session, gateway, chat(5, stream=False))
        assert status >= 500, (status, raw)
        # The response that was streaming when the service died goes on to its end.
        rest = await streaming.content.read()
        events = [
            line[6:] for line in (first + rest).decode().splitlines() if line.startswith("data: ")
        ]
        assert events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["usage"]["completion_tokens"] == _LONG
        streaming.release()

        await restarted(gateway)
        status, response_headers, raw = await post(session, gateway, chat(5, stream=False))
        assert status == 200, raw
        assert orjson.loads(raw)["usage"]["completion_tokens"] == 5
        assert "x-ratelimit-remaining-requests" in response_headers
        # The restarted service knows nothing of the requests before it, and leaks nothing.
        view = await wait_for_view(session, gateway, settled)
        assert view["tenants"]["globex"]["inflight"] == 0
        pools = (await tenants_view(session, gateway))["pools"]
        assert pools["short"]["inflight"] == 0 and pools["long"]["inflight"] == 0


async def test_a_non_streamed_response_generating_through_a_crash_is_served_whole(
    gateway: RunningGateway,
) -> None:
    """A non-streamed response has its headers only when generation ends: the admission stream
    must not be open until then, or the crash cuts it. The headers the admission stream asked
    for (x-ratelimit-*, the queue wait) still reach the client; the engine's address does not.
    The restarted service charges only what it sees."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        generating = asyncio.ensure_future(post(session, gateway, chat(_LONG, stream=False)))
        await wait_for_view(session, gateway, lambda v: v["tenants"]["globex"]["inflight"] == 1)
        kill_service(gateway)
        assert not generating.done()
        status, headers, raw = await post(session, gateway, chat(5, stream=False))
        assert status == 503, (status, raw)
        assert int(headers["Retry-After"]) >= 1
        assert openai_error(raw)["type"] == "service_unavailable"

        status, headers, raw = await generating
        assert status == 200, raw
        assert orjson.loads(raw)["usage"]["completion_tokens"] == _LONG
        assert headers["x-ratelimit-limit-requests"] == "600"
        assert float(headers["x-gateway-queue-ms"]) >= 0.0
        assert "x-gateway-upstream" not in {name.lower() for name in headers}

        await restarted(gateway)
        status, headers, raw = await post(session, gateway, chat(5, stream=False))
        assert status == 200, raw
        usage = orjson.loads(raw)["usage"]
        assert "x-ratelimit-remaining-requests" in headers
        view = await wait_for_view(session, gateway, settled)
        assert view["tenants"]["globex"]["inflight"] == 0
        metrics = await scrape(session, gateway.admin_url + "/metrics")

    def counted(direction: str) -> float:
        key = ("extproc_tokens_total", ("direction", direction), ("tenant", "globex"))
        return metrics.get(key, 0.0)

    # The response that outlived the crash is nobody's charge now; the new one is counted once.
    assert counted("output") == usage["completion_tokens"] == 5
    assert counted("input") == usage["prompt_tokens"]


async def test_requests_during_an_outage_get_an_openai_503_with_retry_after(
    gateway: RunningGateway,
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        kill_service(gateway)
        status, headers, raw = await post(session, gateway, chat(5, stream=False))
        assert status == 503, (status, raw)
        assert int(headers["Retry-After"]) >= 1
        assert openai_error(raw)["type"] == "service_unavailable"
