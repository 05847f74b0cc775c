"""Client -> real Envoy -> ext_proc service -> emulated engines for the pooling endpoints:
embeddings, rerank and score admitted, routed to the pool that serves them, and the tenant
charged what the engine counted; without a pooling pool, the OpenAI 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TEST_KEYS, free_port, policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.pooling_support import (
    EMBED_POOL,
    embeddings_body,
    pooling_policy_yaml,
    rerank_body,
    score_body,
)

pytestmark = pytest.mark.dataplane

HTTP = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2, read=30), retries=False)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    embed = f"127.0.0.1:{free_port()}"

    def make(short: str, long_: str) -> str:
        return pooling_policy_yaml(embed, short_endpoint=short, long_endpoint=long_)

    with running_gateway(tmp_path_factory.mktemp("pooling"), make) as running:
        yield running


def post(gateway: RunningGateway, path: str, body: dict[str, Any]) -> urllib3.BaseHTTPResponse:
    headers = {
        "content-type": "application/json",
        "authorization": f"Bearer {TEST_KEYS['initech']}",
    }
    return HTTP.request("POST", gateway.base_url + path, body=orjson.dumps(body), headers=headers)


def scrape(url: str) -> dict[tuple[str, ...], float]:
    text = HTTP.request("GET", url).data.decode()
    values: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, *sorted(sample.labels.items()))] = sample.value  # type: ignore[arg-type]
    return values


def total(values: dict[tuple[str, ...], float], name: str) -> float:
    return sum(v for k, v in values.items() if k[0] == name)


def counted(gateway: RunningGateway, direction: str) -> float:
    key = ("extproc_tokens_total", ("direction", direction), ("tenant", "initech"))
    return scrape(gateway.admin_url + "/metrics").get(key, 0.0)


def engine_of(gateway: RunningGateway, pool: str) -> str:
    (endpoint,) = gateway.policy.pools[pool].endpoints
    return f"http://{endpoint}/metrics"


def settled_pools(gateway: RunningGateway) -> bool:
    view = orjson.loads(HTTP.request("GET", gateway.admin_url + "/v1/tenants").data)
    return all(p["inflight"] == 0 for p in view["pools"].values())


CALLS = [
    ("/v1/embeddings", embeddings_body(["first input text", "the second one", "3"])),
    ("/v1/embeddings", embeddings_body([[5, 6, 7, 8], [9, 10]])),
    ("/v1/rerank", rerank_body("what is a cat", ["a cat is an animal", "paris is a city"])),
    ("/v1/score", score_body(["q one", "q two"], ["doc one", "doc two"])),
]


def test_pooling_calls_are_routed_to_the_pooling_pool_and_accounted(
    gateway: RunningGateway,
) -> None:
    engine_before = scrape(engine_of(gateway, EMBED_POOL))
    short_before = scrape(engine_of(gateway, "short"))
    input_before, output_before = counted(gateway, "input"), counted(gateway, "output")
    reported = 0
    for path, body in CALLS:
        response = post(gateway, path, body)
        assert response.status == 200, (path, response.data)
        assert response.headers["x-engine-id"].startswith(EMBED_POOL)
        assert "x-gateway-queue-ms" in response.headers
        assert response.headers["content-type"].startswith("application/json")
        answer = orjson.loads(response.data)
        assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
        reported += answer["usage"]["prompt_tokens"]
    assert orjson.loads(post(gateway, *CALLS[1]).data)["usage"]["prompt_tokens"] == 6  # exact ids
    reported += 6
    engine_after = scrape(engine_of(gateway, EMBED_POOL))
    engine_prompt = total(engine_after, "vllm:prompt_tokens_total") - total(
        engine_before, "vllm:prompt_tokens_total"
    )
    assert engine_prompt == reported
    # The generative pool saw none of it.
    short_after = scrape(engine_of(gateway, "short"))
    assert total(short_after, "vllm:prompt_tokens_total") == total(
        short_before, "vllm:prompt_tokens_total"
    )
    # Settled from each response's usage: the tenant is charged exactly the engine's count.
    for _ in range(200):
        if counted(gateway, "input") - input_before == reported and settled_pools(gateway):
            break
        HTTP.request("GET", gateway.admin_url + "/v1/tenants")  # paced by the round trip
    assert counted(gateway, "input") - input_before == reported
    assert counted(gateway, "output") == output_before


def test_chat_still_goes_to_the_generative_pool(gateway: RunningGateway) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = post(gateway, "/v1/chat/completions", chat)
    assert response.status == 200 and response.headers["x-engine-id"].startswith("short")


def test_a_bad_rerank_body_gets_the_openai_400(gateway: RunningGateway) -> None:
    response = post(gateway, "/v1/rerank", {"model": "m", "query": "q", "documents": []})
    assert response.status == 400
    error = orjson.loads(response.data)["error"]
    assert error["type"] == "invalid_request_error" and "documents" in error["message"]


def test_embeddings_without_a_pooling_pool_get_the_openai_404(tmp_path: Path) -> None:
    with running_gateway(tmp_path, lambda short, long_: policy_yaml(short, long_)) as plain:
        response = post(plain, "/v1/embeddings", embeddings_body("hello"))
        assert response.status == 404
        assert response.headers["content-type"].startswith("application/json")
        error = orjson.loads(response.data)["error"]
        assert error["code"] == "endpoint_not_served" and "embeddings" in error["message"]
        # Envoy's allowlist forwarded it to admission, which answered; no engine saw it.
        for pool in ("short", "long"):
            assert total(scrape(engine_of(plain, pool)), "vllm:prompt_tokens_total") == 0
