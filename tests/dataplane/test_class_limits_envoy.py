"""Limits per endpoint class through the real Envoy: a tenant's chat bucket (its own burst)
answers 429 with an honest Retry-After and headers that name it, while the same tenant's
completions pass; /v1/tenants shows the class's bucket."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway

pytestmark = pytest.mark.dataplane

CHAT_BURST = 3
GLOBEX_LIMITS = (
    "{requests_per_minute: 600, tokens_per_minute: 10000000, max_queued: 50, per_endpoint: "
    f"{{chat: {{requests_per_minute: 30, requests_burst: {CHAT_BURST}}}}}}}"
)
TIMEOUT = aiohttp.ClientTimeout(total=30)


def class_policy(short: str, long_: str) -> str:
    return policy_yaml(short, long_, globex_limits=GLOBEX_LIMITS)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with running_gateway(tmp_path_factory.mktemp("class_limits"), class_policy) as running:
        yield running


async def post(
    session: aiohttp.ClientSession, gateway: RunningGateway, path: str, body: dict[str, Any]
) -> tuple[int, dict[str, str], bytes]:
    headers = {"authorization": f"Bearer {TEST_KEYS['globex']}"}
    async with session.post(gateway.base_url + path, json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 1}


async def test_a_chat_bucket_rejects_chat_while_completions_pass(gateway: RunningGateway) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for _ in range(CHAT_BURST):
            status, headers, _ = await post(session, gateway, "/v1/chat/completions", CHAT)
            assert status == 200
            assert headers["x-ratelimit-limit-requests-chat"] == str(CHAT_BURST)
            assert headers["x-ratelimit-limit-requests"] == "600"
        assert headers["x-ratelimit-remaining-requests-chat"] == "0"
        status, headers, body = await post(session, gateway, "/v1/chat/completions", CHAT)
        assert status == 429
        error = orjson.loads(body)["error"]
        assert error["type"] == "rate_limit_error"
        assert "per_endpoint.chat.requests_per_minute" in error["message"]
        retry_after = int(headers["Retry-After"])
        assert 1 <= retry_after <= 2  # 30/min refills one request every 2 s
        assert headers["x-ratelimit-remaining-requests-chat"] == "0"
        assert headers["x-ratelimit-limit-requests-chat"] == str(CHAT_BURST)
        assert int(headers["x-ratelimit-remaining-requests"]) >= 600 - CHAT_BURST - 1
        status, headers, _ = await post(session, gateway, "/v1/completions", COMPLETION)
        assert status == 200  # the same tenant, another class: only the tenant-wide bucket
        assert "x-ratelimit-limit-requests-chat" not in headers
        async with session.get(gateway.admin_url + "/v1/tenants") as response:
            globex = orjson.loads(await response.read())["tenants"]["globex"]
        assert set(globex["buckets"]) == {"requests", "tokens", "requests-chat"}
        assert globex["bucket_limits"]["requests-chat"] == {
            "capacity": float(CHAT_BURST), "limit": 30.0, "period_s": 60.0, "endpoint": "chat",
        }  # fmt: skip
        await asyncio.sleep(retry_after)  # waiting as told is the behaviour under test
        status, headers, _ = await post(session, gateway, "/v1/chat/completions", CHAT)
        assert status == 200
