"""Client -> real Envoy -> ext_proc service -> a real vLLM (CPU) pooling engine.

The random-weight tiny model runs under vLLM's pooling runner as an embedding model
(`--runner pooling --convert embed`, the launcher's pooling preset), which serves
/v1/embeddings and, scoring by cosine similarity, /v1/rerank and /v1/score. Beside it one
generative engine serves chat. Each call must be admitted, routed to the pooling engine only,
and the tenant charged exactly what that engine counted (vllm:prompt_tokens_total).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TEST_KEYS
from tests.pooling_support import (
    EMBED_POOL,
    chat_and_pooling_policy_yaml,
    embeddings_body,
    rerank_body,
    score_body,
)
from tests.vllm.test_gateway_vllm import cl100k_count, vllm_gateway_or_skip

pytestmark = [pytest.mark.vllm, pytest.mark.dataplane]

HTTP = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5, read=120), retries=False)
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp("pooling-vllm")
    with vllm_gateway_or_skip(workdir, chat_and_pooling_policy_yaml) as running:
        yield running


def post(gateway: Any, path: str, body: dict[str, Any]) -> urllib3.BaseHTTPResponse:
    headers = {"content-type": "application/json", "authorization": f"Bearer {TEST_KEYS['acme']}"}
    return HTTP.request("POST", gateway.base_url + path, body=orjson.dumps(body), headers=headers)


def scrape(url: str) -> dict[tuple[str, ...], float]:
    text = HTTP.request("GET", url).data.decode()
    values: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, *sorted(sample.labels.items()))] = sample.value  # type: ignore[arg-type]
    return values


def engine_count(gateway: Any, pool: str, name: str) -> float:
    values = scrape(gateway.engines[pool] + "/metrics")
    return sum(v for k, v in values.items() if k[0] == name)


def counted(gateway: Any, direction: str) -> float:
    key = ("extproc_tokens_total", ("direction", direction), ("tenant", "acme"))
    return scrape(gateway.admin_url + "/metrics").get(key, 0.0)


def settled(gateway: Any, expected_input: float) -> bool:
    view = orjson.loads(HTTP.request("GET", gateway.admin_url + "/v1/tenants").data)
    idle = all(p["inflight"] == 0 for p in view["pools"].values())
    return idle and counted(gateway, "input") == expected_input


TEXTS = ["Hello, world!", "Embeddings are batches of input only.", "中文文本的分词测试"]
QUERY, DOCUMENTS = "what is a cat", ["a cat is an animal", "paris is a city", "cats purr"]
CALLS = [
    ("/v1/embeddings", embeddings_body(TEXTS, MODEL)),
    ("/v1/embeddings", embeddings_body([[9906, 11, 1917], [1115, 374]], MODEL)),
    ("/v1/rerank", rerank_body(QUERY, DOCUMENTS, MODEL)),
    ("/v1/score", score_body(QUERY, DOCUMENTS, MODEL)),
]


def test_pooling_calls_reach_the_pooling_engine_and_are_charged_its_count(gateway: Any) -> None:
    pooled_before = engine_count(gateway, EMBED_POOL, "vllm:prompt_tokens_total")
    chat_before = engine_count(gateway, "short", "vllm:prompt_tokens_total")
    input_before, output_before = counted(gateway, "input"), counted(gateway, "output")
    usages = {}
    for path, body in CALLS:
        response = post(gateway, path, body)
        assert response.status == 200, (path, response.data[:500])
        assert "x-gateway-queue-ms" in response.headers
        usages[(path, len(usages))] = orjson.loads(response.data)["usage"]["prompt_tokens"]
    reported = sum(usages.values())
    # The tokenizer is cl100k's and vLLM adds nothing to an embedding input: the estimator's
    # own count of the texts is the engine's (ids are counted as given).
    embedded, ids, reranked, scored = usages.values()
    assert embedded == sum(cl100k_count(text) for text in TEXTS)
    assert ids == 5
    # A bi-encoder embeds the query once and each document once, on both endpoints.
    each_once = cl100k_count(QUERY) + sum(cl100k_count(d) for d in DOCUMENTS)
    assert reranked == scored == each_once
    pooled = engine_count(gateway, EMBED_POOL, "vllm:prompt_tokens_total") - pooled_before
    assert pooled == reported
    assert engine_count(gateway, "short", "vllm:prompt_tokens_total") == chat_before
    for _ in range(300):  # each poll is a round trip to the admin server
        if settled(gateway, input_before + reported):
            break
    assert counted(gateway, "input") - input_before == pooled
    assert counted(gateway, "output") == output_before
    assert engine_count(gateway, EMBED_POOL, "vllm:generation_tokens_total") == 0


def test_the_response_shapes_are_vllms(gateway: Any) -> None:
    embedded = orjson.loads(post(gateway, *CALLS[0]).data)
    assert embedded["object"] == "list" and len(embedded["data"]) == len(TEXTS)
    assert all(d["object"] == "embedding" and d["embedding"] for d in embedded["data"])
    reranked = orjson.loads(post(gateway, *CALLS[2]).data)
    assert set(reranked["usage"]) == {"prompt_tokens", "total_tokens"}
    assert sorted(r["index"] for r in reranked["results"]) == [0, 1, 2]
    scored = orjson.loads(post(gateway, *CALLS[3]).data)
    assert [d["object"] for d in scored["data"]] == ["score"] * 3


def test_chat_still_reaches_the_generative_engine(gateway: Any) -> None:
    before = engine_count(gateway, "short", "vllm:generation_tokens_total")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = post(gateway, "/v1/chat/completions", chat)
    assert response.status == 200, response.data[:300]
    assert engine_count(gateway, "short", "vllm:generation_tokens_total") - before >= 1
