"""Every token counted: the gateway's per-tenant counts equal the engines' own usage."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TEST_KEYS, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.dataplane.test_admission import settled, wait_for_view

pytestmark = pytest.mark.dataplane

LIMITS = "{requests_per_minute: 6000, tokens_per_minute: 10000000, max_queued: 500}"


@pytest.fixture(scope="module", params=["in-process", "accounting-process", "count-in-envoy"])
def gateway(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningGateway]:
    """Every layout: the accounting streams on the admission process, or in its child
    (`serve --accounting-grpc`, Envoy's own accounting cluster), or no accounting stream at
    all, Envoy counting (`serve --envoy-events`, extproc.envoy_lua): the same exact counts."""

    def make(short: str, long_: str) -> str:
        return policy_yaml(short, long_, acme_limits=LIMITS, globex_limits=LIMITS, short_inflight=8)

    child = request.param == "accounting-process"
    workdir = tmp_path_factory.mktemp("accounting")
    in_envoy = request.param == "count-in-envoy"
    with running_gateway(
        workdir, make, accounting_process=child, count_in_envoy=in_envoy
    ) as running:
        yield running


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, ...], float]:
    async with session.get(url) as response:
        text = await response.text()
    values: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, *sorted(sample.labels.items()))] = sample.value  # type: ignore[arg-type]
    return values


def usage_of_stream(raw: bytes) -> dict[str, int] | None:
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    usages = [orjson.loads(e)["usage"] for e in events if e != "[DONE]" and '"usage"' in e]
    found = [u for u in usages if u]
    return found[-1] if found else None


async def one_request(
    session: aiohttp.ClientSession,
    gateway: RunningGateway,
    tenant: str,
    kind: str,
    rng: random.Random,
) -> dict[str, int] | None:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "count me " * rng.randint(1, 60)}],
        "max_tokens": rng.randint(3, 60),
    }
    if kind != "plain":
        body["stream"] = True
    if kind == "stream_usage":
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {TEST_KEYS[tenant]}"}
    url = gateway.base_url + "/v1/chat/completions"
    async with session.post(url, json=body, headers=headers) as response:
        assert response.status == 200
        if kind == "abandon":
            first = await response.content.readany()  # read the first chunk(s), then hang up
            response.close()
            seen = first.count(b'"content":"') - first.count(b'"content":""')
            return {"abandoned_deltas_seen": seen}
        raw = await response.read()
    if kind == "plain":
        return orjson.loads(raw)["usage"]  # type: ignore[no-any-return]
    usage = usage_of_stream(raw)
    assert usage is not None, "the gateway makes sure every stream ends with usage"
    return usage


async def test_counted_tokens_equal_engine_usage(gateway: RunningGateway) -> None:
    rng = random.Random(11)
    plan = [
        (tenant, kind)
        for tenant, kinds in (
            ("acme", ["plain", "stream_usage", "stream_plain"]),
            ("globex", ["plain", "stream_usage", "stream_plain", "abandon"]),
        )
        for kind in kinds
        for _ in range(15)
    ]
    rng.shuffle(plan)
    reported: dict[str, Counter[str]] = {"acme": Counter(), "globex": Counter()}
    async with aiohttp.ClientSession() as session:
        # Corrections count from a base reading of each engine, taken at a quiet moment.
        await wait_for_view(session, gateway, engines_have_base(gateway))
        before = await scrape(session, gateway.admin_url + "/metrics")
        engines_before = [
            await scrape(session, f"http://{endpoint}/metrics")
            for pool in gateway.policy.pools.values()
            for endpoint in pool.endpoints
        ]
        results = await asyncio.gather(
            *(one_request(session, gateway, tenant, kind, rng) for tenant, kind in plan)
        )
        client_seen = 0
        for (tenant, _), usage in zip(plan, results, strict=True):
            if "abandoned_deltas_seen" in usage:
                client_seen += usage["abandoned_deltas_seen"]
                continue
            reported[tenant]["input"] += usage["prompt_tokens"]
            reported[tenant]["output"] += usage["completion_tokens"]
        # Every stream settled, and the cut-short ones corrected from the engines' counters.
        final_view = await wait_for_view(session, gateway, settled_and_reconciled)
        after = await scrape(session, gateway.admin_url + "/metrics")
        engines_after = [
            await scrape(session, f"http://{endpoint}/metrics")
            for pool in gateway.policy.pools.values()
            for endpoint in pool.endpoints
        ]

    def counted(tenant: str, direction: str) -> float:
        key = ("extproc_tokens_total", ("direction", direction), ("tenant", tenant))
        return after.get(key, 0.0) - before.get(key, 0.0)

    def engine_total(name: str) -> float:
        total = 0.0
        for start, end in zip(engines_before, engines_after, strict=True):
            total += sum(v for k, v in end.items() if k[0] == name)
            total -= sum(v for k, v in start.items() if k[0] == name)
        return total

    # A tenant whose requests all complete: exactly what the engine reported in the responses.
    assert counted("acme", "input") == reported["acme"]["input"]
    assert counted("acme", "output") == reported["acme"]["output"]
    # Abandoned streams never get a usage chunk; the gateway corrects their charge from the
    # engines' counters, which count every token, aborted requests' too. So all tenants
    # together equal the engines exactly, and globex (the only one abandoning) gets the rest.
    figures = {
        "counted": {t: {d: counted(t, d) for d in ("input", "output")} for t in reported},
        "reported": reported,
        "reconciliation": final_view["state"]["reconciliation"],
        "client_seen": client_seen,
        "engine_prompt": engine_total("vllm:prompt_tokens_total"),
        "engine_output": engine_total("vllm:generation_tokens_total"),
    }
    assert counted("acme", "input") + counted("globex", "input") == engine_total(
        "vllm:prompt_tokens_total"
    ), figures
    assert counted("acme", "output") + counted("globex", "output") == engine_total(
        "vllm:generation_tokens_total"
    ), figures
    abandoned_output = counted("globex", "output") - reported["globex"]["output"]
    assert abandoned_output >= client_seen, figures
    # Their request log lines say the token counts there are the provisional ones.
    provisional = Counter(
        entry["tenant"] for entry in request_log(gateway) if entry.get("tokens_provisional")
    )
    assert provisional["globex"] >= 1 and provisional["acme"] == 0, provisional


def request_log(gateway: RunningGateway) -> list[dict[str, Any]]:
    entries = []
    for line in gateway.log_of("extproc").splitlines():
        if line.startswith("{") and '"logger":"extproc.request"' in line:
            entries.append(orjson.loads(line))
    return entries


def settled_and_reconciled(view: dict[str, Any]) -> bool:
    reconciliation = view["state"]["reconciliation"]
    return settled(view) and reconciliation["enabled"] and reconciliation["pending"] == 0


def engines_have_base(gateway: RunningGateway) -> Any:
    endpoints = {e for pool in gateway.policy.pools.values() for e in pool.endpoints}

    def check(view: dict[str, Any]) -> bool:
        return endpoints <= set(view["state"]["reconciliation"]["engines_with_base"])

    return check


async def engine_running(session: aiohttp.ClientSession, endpoint: str) -> float:
    values = await scrape(session, f"http://{endpoint}/metrics")
    return sum(v for k, v in values.items() if k[0] == "vllm:num_requests_running")


async def test_clients_gone_before_the_response_are_counted_exactly(
    gateway: RunningGateway,
) -> None:
    """A client that leaves after its admission, before the engine's response headers, is
    charged what the engine used (its counters), not its prompt estimate for good."""
    (engine,) = gateway.policy.pools["short"].endpoints
    headers = {"authorization": f"Bearer {TEST_KEYS['globex']}"}
    url = gateway.base_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        await wait_for_view(session, gateway, engines_have_base(gateway))
        logged_before = len(request_log(gateway))
        before = await scrape(session, gateway.admin_url + "/metrics")
        engine_before = await scrape(session, f"http://{engine}/metrics")
        for words in (5, 40, 80, 20):
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "leave me " * words}],
                "max_tokens": 1800,  # not streamed: the response headers come at the end
            }
            async with asyncio.timeout(10):  # the previous one is aborted at the engine
                while await engine_running(session, engine):
                    await asyncio.sleep(0.01)
            sent = asyncio.ensure_future(session.post(url, json=body, headers=headers))
            async with asyncio.timeout(10):
                while not await engine_running(session, engine):
                    assert not sent.done(), "the response came before the client could leave"
            sent.cancel()  # the client leaves while the engine generates
            with contextlib.suppress(asyncio.CancelledError):
                await sent
        view = await wait_for_view(session, gateway, settled_and_reconciled)
        after = await scrape(session, gateway.admin_url + "/metrics")
        engine_after = await scrape(session, f"http://{engine}/metrics")

    def counted(direction: str) -> float:
        key = ("extproc_tokens_total", ("direction", direction), ("tenant", "globex"))
        return after.get(key, 0.0) - before.get(key, 0.0)

    def engine_total(name: str) -> float:
        return sum(v for k, v in engine_after.items() if k[0] == name) - sum(
            v for k, v in engine_before.items() if k[0] == name
        )

    figures = {"reconciliation": view["state"]["reconciliation"]}
    assert engine_total("vllm:generation_tokens_total") > 0, figures
    assert counted("input") == engine_total("vllm:prompt_tokens_total"), figures
    assert counted("output") == engine_total("vllm:generation_tokens_total"), figures
    # Each one's log line, written once its accounting stream closed (Envoy keeps it open a
    # little after the request ends), says its counts are the provisional ones.
    async with asyncio.timeout(10):
        while len(entries := request_log(gateway)[logged_before:]) < 4:
            await asyncio.sleep(0.05)
    assert [(e["outcome"], e["upstream_status"], e["tokens_provisional"]) for e in entries] == [
        ("admitted", None, True)
    ] * 4, entries


async def test_every_short_response_in_a_burst_gives_a_first_token(
    gateway: RunningGateway,
) -> None:
    """A response of one or two chunks ends right after its first: with counting in Envoy its
    end can overtake the `/first` call, and then carries the first chunk's time itself."""
    headers = {"authorization": f"Bearer {TEST_KEYS['acme']}"}
    url = gateway.base_url + "/v1/chat/completions"
    ttft = ("extproc_ttft_seconds_count", ("pool", "short"), ("tenant", "acme"))

    async def short(session: aiohttp.ClientSession, stream: bool) -> None:
        body = {"model": "m", "stream": stream, "max_tokens": 1,
                "messages": [{"role": "user", "content": "quick"}]}  # fmt: skip
        async with session.post(url, json=body, headers=headers) as response:
            assert response.status == 200
            await response.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await wait_for_view(session, gateway, settled)
        before = await scrape(session, gateway.admin_url + "/metrics")
        await asyncio.gather(*(short(session, i % 2 == 0) for i in range(24)))
        await wait_for_view(session, gateway, settled)
        after = await scrape(session, gateway.admin_url + "/metrics")
    assert after.get(ttft, 0.0) - before.get(ttft, 0.0) == 24


async def envoy_stat(gateway: RunningGateway, name: str) -> int:
    url = f"http://{gateway.config.envoy_admin}/stats?filter=^{name}$"
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        text = (await answer.text()).strip()
    return int(text.split(": ")[1]) if text else 0


async def test_requests_refused_at_admission_send_no_access_log_entry(
    gateway: RunningGateway,
) -> None:
    """Envoy logs to the service only the streams its counting filter followed: a flood of
    refusals costs the service nothing to read and drop."""
    if gateway.config.envoy_events is None:
        pytest.skip("an accounting stream counts here: no access log to the service")
    url = gateway.base_url + "/v1/chat/completions"
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    written = "access_logs.grpc_access_log.logs_written"
    before = await envoy_stat(gateway, written)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for key, status in [(TEST_KEYS["acme"], 200)] * 3 + [("sk-not-a-key", 401)] * 5:
            headers = {"authorization": f"Bearer {key}"}
            async with session.post(url, json=body, headers=headers) as response:
                assert response.status == status
                await response.read()
        await wait_for_view(session, gateway, settled)
    assert await envoy_stat(gateway, written) - before == 3


async def test_first_tokens_and_gaps_reach_the_service(gateway: RunningGateway) -> None:
    """Whatever counts (an accounting stream, or Envoy's script and its calls), the service
    sees each streamed response's first token (the TTFT histogram, prefill pacing) and its
    later output as it passes (the inter-token histogram, weighted per token)."""
    headers = {"authorization": f"Bearer {TEST_KEYS['acme']}"}
    url = gateway.base_url + "/v1/chat/completions"
    ttft = ("extproc_ttft_seconds_count", ("pool", "short"), ("tenant", "acme"))
    gaps = ("extproc_inter_token_seconds_count", ("pool", "short"), ("tenant", "acme"))
    async with aiohttp.ClientSession() as session:
        await wait_for_view(session, gateway, settled)
        before = await scrape(session, gateway.admin_url + "/metrics")
        for _ in range(3):
            body = {"model": "m", "stream": True, "max_tokens": 40,
                    "messages": [{"role": "user", "content": "time me"}]}  # fmt: skip
            async with session.post(url, json=body, headers=headers) as response:
                assert response.status == 200
                await response.read()
        await wait_for_view(session, gateway, settled)
        after = await scrape(session, gateway.admin_url + "/metrics")
    assert after.get(ttft, 0.0) - before.get(ttft, 0.0) == 3
    # One gap per token after the first with a message per chunk (about 39 per response);
    # with Envoy's calls every 16 chunks, a gap between two calls is weighted by the tokens
    # between them: at least the 15 between its first call (chunk 1) and its second (16).
    assert after.get(gaps, 0.0) - before.get(gaps, 0.0) >= 3 * 15
    if gateway.config.envoy_events is not None:
        # The counting script ran to the end of every response: Envoy counted no script error.
        url = f"http://{gateway.config.envoy_admin}/stats?filter=lua"
        async with aiohttp.ClientSession() as session, session.get(url) as answer:
            stats = dict(line.split(": ") for line in (await answer.text()).splitlines())
        assert stats["http.llm_gateway.lua.counting.errors"] == "0", stats
