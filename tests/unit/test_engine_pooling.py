"""The emulated engine's pooling requests: a prefill and nothing else in the core; vLLM's
response shapes and counters on /v1/embeddings, /v1/rerank and /v1/score."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway_lab.engine.model import EngineCore
from gateway_lab.engine.pooling_api import EMBEDDING_SIZE
from gateway_lab.engine.profiles import get_profile
from gateway_lab.engine.server import DEFAULT_MODEL, EngineServer
from gateway_lab.engine.tokens import text_tokens
from tests.unit.test_engine_model import ROUND, run_to_completion
from tests.unit.test_engine_server import metric_value, scrape


def test_a_pooling_request_is_one_prefill_with_no_decode() -> None:
    core = EngineCore(ROUND)
    core.add_request("e", prompt_tokens=300, max_tokens=0, pooling=True)
    [step] = run_to_completion(core)
    assert step.num_prefill_tokens == 300 and step.num_decodes == 0
    assert step.output == () and step.first_token == ()
    [finished] = step.finished
    assert finished.req_id == "e" and finished.output_tokens == 0
    assert core.prompt_tokens_total == 300 and core.generation_tokens_total == 0
    assert core.num_running == 0 and core.free_blocks == ROUND.kv_blocks


def test_a_long_pooling_prompt_is_chunked_like_any_prefill() -> None:
    core = EngineCore(ROUND)  # 512 tokens per step
    core.add_request("e", prompt_tokens=1200, max_tokens=0, pooling=True)
    steps = run_to_completion(core)
    assert [s.num_prefill_tokens for s in steps] == [512, 512, 176]
    assert [len(s.finished) for s in steps] == [0, 0, 1]


def test_pooling_beside_decodes_costs_only_its_prefill() -> None:
    core = EngineCore(ROUND)
    core.add_request("chat", prompt_tokens=10, max_tokens=3)
    core.add_request("embed", prompt_tokens=40, max_tokens=0, pooling=True)
    steps = run_to_completion(core)
    assert core.generation_tokens_total == 3 and core.prompt_tokens_total == 50
    assert steps[0].num_prefill_tokens == 50
    assert sum(s.num_decodes for s in steps) == 2  # the chat request's; none for the embedding


def test_pooling_requests_have_no_output_and_others_need_some() -> None:
    core = EngineCore(ROUND)
    with pytest.raises(ValueError, match="no output"):
        core.add_request("a", prompt_tokens=5, max_tokens=2, pooling=True)
    with pytest.raises(ValueError, match="at least 1"):
        core.add_request("b", prompt_tokens=5, max_tokens=0)


@pytest.fixture
async def engine() -> AsyncIterator[EngineServer]:
    server = EngineServer(get_profile("fast"), engine_id="engine-p")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def post(engine: EngineServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(engine.base_url + path, json=body) as resp,
    ):
        assert resp.content_type == "application/json"
        return resp.status, orjson.loads(await resp.read())


async def test_embeddings_shape_usage_and_counters(engine: EngineServer) -> None:
    texts = ["hello world", "a second, longer input text"]
    status, body = await post(engine, "/v1/embeddings", {"model": DEFAULT_MODEL, "input": texts})
    assert status == 200
    assert set(body) == {"id", "object", "created", "model", "data", "usage"}
    assert body["object"] == "list" and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    assert all(len(d["embedding"]) == EMBEDDING_SIZE for d in body["data"])
    prompt = sum(text_tokens(t) for t in texts)
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "total_tokens": prompt,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    status, ids = await post(engine, "/v1/embeddings", {"input": [[1, 2, 3], [4, 5]]})
    assert status == 200 and ids["usage"]["prompt_tokens"] == 5
    async with aiohttp.ClientSession() as session:
        metrics = await scrape(session, engine)
    # vLLM counts one engine request per input, finished by "stop", and no generation.
    assert metric_value(metrics, "vllm:prompt_tokens_total") == prompt + 5
    assert metric_value(metrics, "vllm:request_success_total", finished_reason="stop") == 4
    assert metric_value(metrics, "vllm:request_success_total", finished_reason="length") == 0
    assert metric_value(metrics, "vllm:generation_tokens_total") == 0


async def test_base64_embeddings_hold_the_same_vector(engine: EngineServer) -> None:
    _, floats = await post(engine, "/v1/embeddings", {"input": "same text"})
    _, packed = await post(
        engine, "/v1/embeddings", {"input": "same text", "encoding_format": "base64"}
    )
    raw = base64.b64decode(packed["data"][0]["embedding"])
    vector = struct.unpack(f"<{EMBEDDING_SIZE}f", raw)
    assert vector == pytest.approx(floats["data"][0]["embedding"], abs=1e-6)


async def test_rerank_and_score_count_every_text_once(engine: EngineServer) -> None:
    query, documents = "what is a cat", ["a cat is an animal", "paris is a city", "x"]
    prompt = text_tokens(query) + sum(text_tokens(d) for d in documents)
    status, rerank = await post(
        engine, "/v1/rerank", {"query": query, "documents": documents, "top_n": 2}
    )
    assert status == 200 and set(rerank) == {"id", "model", "usage", "results"}
    assert rerank["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt}
    assert len(rerank["results"]) == 2
    scores = [r["relevance_score"] for r in rerank["results"]]
    assert scores == sorted(scores, reverse=True)
    first = rerank["results"][0]
    assert first["document"] == {"text": documents[first["index"]], "multi_modal": None}
    status, score = await post(engine, "/v1/score", {"text_1": query, "text_2": documents})
    assert status == 200 and score["usage"]["prompt_tokens"] == prompt
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in score["data"])
    # The same pair scores the same on both endpoints.
    by_index = {r["index"]: r["relevance_score"] for r in rerank["results"]}
    assert all(score["data"][i]["score"] == s for i, s in by_index.items())


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/embeddings", {"input": []}, 400),
        ("/v1/embeddings", {"input": ""}, 400),
        ("/v1/embeddings", {"input": "x" * 4 * 20000}, 400),  # above max_model_len
        ("/v1/embeddings", {"model": "other", "input": "x"}, 404),
        ("/v1/rerank", {"documents": ["a"]}, 400),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400),
    ],
)
async def test_bad_pooling_requests_get_vllm_errors(
    engine: EngineServer, path: str, body: dict[str, Any], status: int
) -> None:
    got, answer = await post(engine, path, body)
    assert got == status
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert engine.core.num_running == 0 and engine.core.num_waiting == 0
