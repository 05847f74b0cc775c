"""The emulated vLLM HTTP server against a real aiohttp client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from gateway_lab.engine.profiles import get_profile
from gateway_lab.engine.server import DEFAULT_MODEL, EngineServer, running_engine
from gateway_lab.engine.tokens import MESSAGE_OVERHEAD_TOKENS, output_text, text_tokens

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
async def engine() -> AsyncIterator[EngineServer]:
    server = EngineServer(get_profile("fast"), engine_id="engine-a")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def wait_until(predicate: Callable[[], Awaitable[bool] | bool], timeout: float = 5.0) -> None:
    """Bounded poll loop: returns as soon as the predicate holds, fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value if isinstance(value, bool) else await value:
            return
        if time.monotonic() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.005)


def chat_body(content: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def read_events(resp: aiohttp.ClientResponse) -> list[Any]:
    """The SSE `data:` payloads in order; "[DONE]" stays a string."""
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def metric_value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


async def scrape(session: aiohttp.ClientSession, engine: EngineServer) -> str:
    async with session.get(engine.base_url + "/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_non_streaming_chat_usage(
    engine: EngineServer, session: aiohttp.ClientSession
) -> None:
    content = "x" * 37
    async with session.post(engine.base_url + CHAT, json=chat_body(content, max_tokens=5)) as resp:
        assert resp.status == 200
        assert resp.headers["x-engine-id"] == "engine-a"
        body = await resp.json()
    prompt_tokens = MESSAGE_OVERHEAD_TOKENS + text_tokens(content)
    assert body["object"] == "chat.completion" and body["model"] == DEFAULT_MODEL
    assert body["id"].startswith("chatcmpl-")
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == prompt_tokens + 5
    (choice,) = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "reasoning_content": None,
        "content": output_text(5),
        "tool_calls": [],
    }
    assert choice["finish_reason"] == "length"


async def test_non_streaming_completion_honours_max_completion_default(
    session: aiohttp.ClientSession,
) -> None:
    async with running_engine(profile="fast", default_max_tokens=4) as engine:
        async with session.post(engine.base_url + COMPLETIONS, json={"prompt": "abcdefgh"}) as resp:
            body = await resp.json()
        assert resp.headers["x-engine-id"] == f"127.0.0.1:{engine.port}"
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == output_text(4)
    assert body["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 6,
        "completion_tokens": 4,
        "prompt_tokens_details": None,
    }


async def test_streaming_chat_chunks_usage_and_done(
    engine: EngineServer, session: aiohttp.ClientSession
) -> None:
    body = chat_body(max_tokens=4, stream=True, stream_options={"include_usage": True})
    async with session.post(engine.base_url + CHAT, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-engine-id"] == "engine-a"
        events = await read_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"]["content"] for c in tokens) == output_text(4)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    prompt_tokens = MESSAGE_OVERHEAD_TOKENS + text_tokens("hello there")
    assert usage_chunk["usage"]["prompt_tokens"] == prompt_tokens
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert usage_chunk["usage"]["total_tokens"] == prompt_tokens + 4


async def test_streaming_completion_without_usage(
    engine: EngineServer, session: aiohttp.ClientSession
) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "stream": True}
    async with session.post(engine.base_url + COMPLETIONS, json=body) as resp:
        events = await read_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 3
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == output_text(3)


async def test_continuous_usage_stats_are_cumulative(
    engine: EngineServer, session: aiohttp.ClientSession
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "hello", "max_tokens": 3, "stream": True, "stream_options": options}
    async with session.post(engine.base_url + COMPLETIONS, json=body) as resp:
        events = await read_events(resp)
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [1, 2, 3, 3]


async def test_metrics_publish_vllm_names(
    engine: EngineServer, session: aiohttp.ClientSession
) -> None:
    async with session.post(engine.base_url + CHAT, json=chat_body(max_tokens=3)) as resp:
        assert resp.status == 200
    async with session.get(engine.base_url + "/metrics") as resp:
        assert resp.headers["x-engine-id"] == "engine-a"
        assert resp.headers["content-type"].startswith("text/plain")
        text = await resp.text()
    labels = {"model_name": DEFAULT_MODEL, "engine": "0"}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    ):
        assert metric_value(text, name, **labels) == 0
    assert metric_value(text, "vllm:prompt_tokens_total") == MESSAGE_OVERHEAD_TOKENS + 3
    assert metric_value(text, "vllm:generation_tokens_total") == 3
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 1
    for hist, count in (
        ("vllm:time_to_first_token_seconds", 1),
        ("vllm:inter_token_latency_seconds", 2),
        ("vllm:time_per_output_token_seconds", 2),
        ("vllm:e2e_request_latency_seconds", 1),
    ):
        assert metric_value(text, hist + "_count") == count
        assert metric_value(text, hist + "_bucket", le="+Inf") == count
    assert "_created" not in text


async def test_models_and_health(engine: EngineServer, session: aiohttp.ClientSession) -> None:
    async with session.get(engine.base_url + "/v1/models") as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL]
    async with session.get(engine.base_url + "/health") as resp:
        assert resp.status == 200
        assert resp.headers["x-engine-id"] == "engine-a"


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "Invalid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (orjson.dumps({"model": "other", "messages": [{"role": "user", "content": "a"}]}), 404,
         "does not exist"),
        (orjson.dumps({"messages": "hi"}), 400, "messages"),
        (orjson.dumps(chat_body(max_tokens=0)), 400, "max_tokens"),
        (orjson.dumps(chat_body(stream_options={"include_usage": True})), 400, "stream=True"),
        (orjson.dumps(chat_body("x" * 400)), 400, "maximum context length is 64"),
        (orjson.dumps(chat_body(max_tokens=60)), 400, "maximum context length is 64"),
    ],
)  # fmt: skip
async def test_bad_requests_get_openai_errors(
    session: aiohttp.ClientSession, body: bytes, status: int, fragment: str
) -> None:
    async with (
        running_engine(profile="fast", max_model_len=64, engine_id="e") as engine,
        session.post(
            engine.base_url + CHAT, data=body, headers={"content-type": "application/json"}
        ) as resp,
    ):
        assert resp.status == status
        assert resp.headers["x-engine-id"] == "e"
        error = (await resp.json())["error"]
    assert error["code"] == status and fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


async def test_batching_queues_beyond_max_num_seqs(session: aiohttp.ClientSession) -> None:
    async with running_engine(profile="fast", max_num_seqs=2) as engine:

        async def one(i: int) -> dict[str, Any]:
            body = {"prompt": "p" * (4 * i + 4), "max_tokens": 30}
            async with session.post(engine.base_url + COMPLETIONS, json=body) as resp:
                result: dict[str, Any] = await resp.json()
                return result

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        await wait_until(lambda: engine.core.num_waiting > 0)
        assert engine.core.num_running <= 2
        results = await asyncio.gather(*tasks)
    assert [r["usage"]["prompt_tokens"] for r in results] == [i + 1 for i in range(6)]
    assert all(r["usage"]["completion_tokens"] == 30 for r in results)


async def test_preemption_shows_in_metrics(session: aiohttp.ClientSession) -> None:
    # 8 blocks of 4 tokens; each request grows to 6 + 23 = 29 tokens (8 blocks). 10 ms steps
    # make the two requests overlap for ~240 ms.
    async with running_engine(
        profile="fast", block_size=4, kv_blocks=8, max_model_len=32, step_base_s=0.01
    ) as engine:

        async def one() -> dict[str, Any]:
            body = {"prompt": "a" * 24, "max_tokens": 24, "stream": None}
            async with session.post(engine.base_url + COMPLETIONS, json=body) as resp:
                result: dict[str, Any] = await resp.json()
                return result

        results = await asyncio.gather(one(), one())
        text = await scrape(session, engine)
    assert all(r["usage"]["completion_tokens"] == 24 for r in results)
    assert metric_value(text, "vllm:num_preemptions_total") >= 1
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0


async def test_a100_profile_short_request_ttft(session: aiohttp.ClientSession) -> None:
    async with running_engine(profile="a100-llama3-8b") as engine:

        async def ttft(first: str) -> float:
            # 4 + 784 / 4 = 200 prompt tokens; `first` decides whether the prompt is fresh.
            body = chat_body(first + "y" * 783, max_tokens=2, stream=True)
            start = time.perf_counter()
            async with session.post(engine.base_url + CHAT, json=body) as resp:
                async for raw in resp.content:
                    if b'"content":" ' in raw:
                        elapsed = time.perf_counter() - start
                        await resp.read()
                        return elapsed
            raise AssertionError("no token")

        await ttft("w")  # warm up the connection
        # Fresh prompts (prefix caching on, as in vLLM): the profile's solo TTFT, ~47 ms.
        samples = [await ttft(str(i)) for i in range(3)]
        # The warm-up prompt again: 12 of its 13 blocks are cached, ~28 ms.
        repeated = [await ttft("w") for _ in range(3)]
    assert 0.035 <= statistics.median(samples) <= 0.070, samples
    assert statistics.median(repeated) <= statistics.median(samples) - 0.010, (repeated, samples)


async def test_disconnect_mid_stream_aborts(
    engine: EngineServer, session: aiohttp.ClientSession
) -> None:
    body = chat_body(max_tokens=5000, stream=True)
    resp = await session.post(engine.base_url + CHAT, json=body)
    await resp.content.readline()  # the first event has arrived
    assert engine.core.num_running == 1 and engine.core.used_blocks > 0
    resp.close()

    async def drained() -> bool:
        return metric_value(await scrape(session, engine), "vllm:num_requests_running") == 0

    await wait_until(drained)
    text = await scrape(session, engine)
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric_value(text, "vllm:generation_tokens_total") < 5000


async def test_disconnect_while_waiting_for_a_full_response_aborts(
    engine: EngineServer, session: aiohttp.ClientSession
) -> None:
    task = asyncio.create_task(
        session.post(engine.base_url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 5000})
    )
    await wait_until(lambda: engine.core.num_running == 1)
    task.cancel()
    await wait_until(lambda: engine.core.num_running == 0 and engine.core.used_blocks == 0)
    assert engine.metrics.success["abort"] == 1


async def test_stop_with_a_request_in_flight(session: aiohttp.ClientSession) -> None:
    async with running_engine(profile="fast") as engine:
        resp = await session.post(
            engine.base_url + CHAT, json=chat_body(max_tokens=5000, stream=True)
        )
        await resp.content.readline()
    # The server stopped promptly and ended the stream.
    await asyncio.wait_for(resp.read(), timeout=5)
    resp.close()


async def test_module_entry_point_serves() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway_lab.engine",
        "--port",
        "0",
        "--profile",
        "fast",
        "--engine-id",
        "cli-engine",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=20)).decode()
        assert line.startswith("engine cli-engine listening on http://127.0.0.1:")
        url = line.split()[-1]
        async with aiohttp.ClientSession() as client, client.get(url + "/health") as resp:
            assert resp.status == 200 and resp.headers["x-engine-id"] == "cli-engine"
    finally:
        if proc.returncode is None:
            proc.terminate()
        assert await asyncio.wait_for(proc.wait(), timeout=10) == 0
