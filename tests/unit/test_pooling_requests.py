"""The pooling endpoints at the unit rung: parsing and validation (OpenAI-style 400s), token
counting, routing by endpoint class, and the policy key `serves`."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.endpoints import ENDPOINTS
from extproc.errors import GatewayError, http_answer
from extproc.estimation import TokenEstimator
from extproc.openai_request import InferenceRequest, parse_inference_request
from extproc.policy import PolicyError, policy_from_text
from extproc.policy.capacity import describe_endpoints
from extproc.policy.model import Estimation
from extproc.prompt import PromptParts
from extproc.routing import choose_pool
from tests.conftest import policy_yaml
from tests.pooling_support import EMBED_POOL, pooling_policy_yaml


def parse(path: str, body: object) -> InferenceRequest:
    return parse_inference_request(path, orjson.dumps(body))


def error_of(path: str, body: object) -> dict[str, object]:
    with pytest.raises(GatewayError) as caught:
        parse(path, body)
    answer = http_answer(caught.value)
    assert answer.status == 400
    error: dict[str, object] = orjson.loads(answer.body)["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == "invalid_request_error"
    return error


def test_the_table_classes_the_new_paths() -> None:
    assert ENDPOINTS["/v1/embeddings"] == "embeddings"
    assert ENDPOINTS["/v1/rerank"] == "rerank"
    assert ENDPOINTS["/v1/score"] == "rerank"


@pytest.mark.parametrize(
    ("inputs", "texts", "ids"),
    [
        ("one text", ["one text"], 0),
        (["a", "b c"], ["a", "b c"], 0),
        ([1, 2, 3, 4], [], 4),
        ([[1, 2], [3], [4, 5, 6]], [], 6),
    ],
)
def test_embeddings_inputs_of_every_shape(inputs: object, texts: list[str], ids: int) -> None:
    request = parse("/v1/embeddings", {"model": "m", "input": inputs, "stream": True})
    assert request.endpoint == "embeddings"
    assert request.prompt.texts == texts and request.prompt.token_ids == ids
    # No output, never a stream: nothing for the processor to ask usage of.
    assert request.max_tokens is None and request.stream is False


def test_the_longest_input_is_what_must_fit_a_pool() -> None:
    """Each input of a batch runs as its own sequence: routing fits the longest one."""
    texts = parse("/v1/embeddings", {"model": "m", "input": ["ab", "a much longer text", "c"]})
    assert texts.longest_input == PromptParts(texts=["a much longer text"])
    ids = parse("/v1/embeddings", {"model": "m", "input": [[1, 2], [3, 4, 5, 6], [7]]})
    assert ids.prompt.token_ids == 7 and ids.longest_input == PromptParts(token_ids=4)
    rerank = parse("/v1/rerank", {"model": "m", "query": "a long query text", "documents": ["d"]})
    assert rerank.longest_input == PromptParts(texts=["a long query text"])
    chat = parse(
        "/v1/chat/completions", {"model": "m", "messages": [{"role": "u", "content": "x"}]}
    )
    assert chat.longest_input is None


def test_embeddings_in_vllm_chat_form() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi there"}]}
    request = parse("/v1/embeddings", body)
    assert request.prompt.texts == ["hi there"] and request.prompt.messages == 1


@pytest.mark.parametrize(
    ("body", "message", "code"),
    [
        ({"model": "m"}, "'input' is required", "missing_field"),
        ({"input": "x"}, "'model' is required", "missing_field"),
        ({"model": "m", "input": []}, "not empty", "invalid_request"),
        ({"model": "m", "input": ["a", 1]}, "one kind throughout", "invalid_request"),
        ({"model": "m", "input": [1, True]}, "one kind throughout", "invalid_request"),
        ({"model": "m", "input": [[1], [-2]]}, "'input[1]'", "invalid_request"),
        ({"model": "m", "input": [[1], []]}, "'input[1]'", "invalid_request"),
        ({"model": "m", "input": {"text": "x"}}, "'input' must be", "invalid_request"),
    ],
)
def test_bad_embeddings_get_openai_400s(body: object, message: str, code: str) -> None:
    error = error_of("/v1/embeddings", body)
    assert message in str(error["message"]) and error["code"] == code


def test_rerank_and_score_estimate_every_input_once() -> None:
    rerank = parse("/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "b"]})
    assert rerank.endpoint == "rerank" and rerank.prompt.texts == ["q", "a", "b"]
    parts = {"content": [{"type": "text", "text": "t1"}, {"type": "image_url", "image_url": {}}]}
    one_to_many = parse("/v1/score", {"model": "m", "text_1": parts, "text_2": ["a", "b"]})
    assert one_to_many.endpoint == "rerank" and one_to_many.prompt.texts == ["t1", "a", "b"]
    pairwise = parse("/v1/score", {"model": "m", "queries": ["x", "y"], "documents": ["a", "b"]})
    assert pairwise.prompt.texts == ["x", "y", "a", "b"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/rerank", {"model": "m", "documents": ["a"]}, "'query' is required"),
        ("/v1/rerank", {"model": "m", "query": "q"}, "'documents' is required"),
        ("/v1/rerank", {"model": "m", "query": "q", "documents": []}, "empty array"),
        ("/v1/rerank", {"model": "m", "query": 3, "documents": ["a"]}, "'query' must be"),
        ("/v1/rerank", {"model": "m", "query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/score", {"model": "m", "text_1": "q"}, "'text_2' is required"),
        ("/v1/score", {"model": "m", "text_1": ["a", "b"], "text_2": ["c"] * 3}, "2 vs 3"),
        ("/v1/score", {"model": "m"}, "needs two sides"),
    ],
)
def test_bad_scoring_requests_get_openai_400s(path: str, body: object, message: str) -> None:
    assert message in str(error_of(path, body)["message"])


@given(st.lists(st.lists(st.integers(0, 200_000), min_size=1, max_size=50), min_size=1))
def test_token_ids_are_counted_exactly(batch: list[list[int]]) -> None:
    request = parse("/v1/embeddings", {"model": "m", "input": batch})
    for mode in ("bytes", "flat"):
        estimator = TokenEstimator(Estimation(mode=mode))  # type: ignore[arg-type]
        assert estimator.estimate_prompt(request.prompt) == sum(map(len, batch))


@given(st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=30))
def test_a_batch_of_texts_estimates_like_its_prompt(texts: list[str]) -> None:
    """Embedding texts are estimated by the prompt rules: a batch costs what the same texts
    cost as a completions prompt list."""
    estimator = TokenEstimator(Estimation())
    embedded = parse("/v1/embeddings", {"model": "m", "input": texts})
    prompted = parse("/v1/completions", {"model": "m", "prompt": texts})
    assert estimator.estimate_prompt(embedded.prompt) == estimator.estimate_prompt(prompted.prompt)


def test_learning_ignores_the_exact_ids() -> None:
    """A request of ids and text learns from the text's share of usage only."""
    estimator = TokenEstimator(Estimation(min_samples=1, decay=0.5))
    text = "a paragraph of ordinary English prose that is long enough to count as prose here"
    mixed = PromptParts(texts=[text], token_ids=1000)
    before = estimator.estimate_prompt(PromptParts(texts=[text]))
    for _ in range(5):
        estimator.observe(mixed, before + 1000)
    assert estimator.estimate_prompt(PromptParts(texts=[text])) == before


def test_routing_by_class_then_budget() -> None:
    policy = policy_from_text(pooling_policy_yaml())
    assert choose_pool(policy, 100, "embeddings") == EMBED_POOL
    assert choose_pool(policy, 8000, "rerank") == EMBED_POOL
    # The pooling pool is never a generative request's, even where only it would fit.
    assert choose_pool(policy, 100, "chat") == "short"
    assert choose_pool(policy, 4000, "completions") == "long"
    with pytest.raises(GatewayError) as caught:
        choose_pool(policy, 9000, "embeddings")
    assert caught.value.code == "context_length_exceeded"
    assert "(its longest input)" in caught.value.message and "8192" in caught.value.message


def test_a_class_no_pool_serves_gets_an_openai_404() -> None:
    policy = policy_from_text(policy_yaml())
    with pytest.raises(GatewayError) as caught:
        choose_pool(policy, 10, "embeddings")
    answer = http_answer(caught.value)
    assert answer.status == 404
    error = orjson.loads(answer.body)["error"]
    assert error["code"] == "endpoint_not_served" and "embeddings" in error["message"]


def test_pools_serve_the_generative_classes_by_default() -> None:
    policy = policy_from_text(policy_yaml())
    assert all(pool.serves == ["chat", "completions"] for pool in policy.pools.values())
    assert policy.pools_by_class["embeddings"] == () == policy.pools_by_class["rerank"]
    assert [name for name, _ in policy.pools_by_class["chat"]] == ["short", "long"]
    assert describe_endpoints(policy_from_text(pooling_policy_yaml()).source) == [
        "chat (/v1/chat/completions): pools short, long",
        "completions (/v1/completions): pools short, long",
        "embeddings (/v1/embeddings): pool embed",
        "rerank (/v1/rerank, /v1/score): pool embed",
    ]


def _issues(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        policy_from_text(text, "p.yaml")
    return [str(issue) for issue in caught.value.issues]


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_pooling_priority_is_an_integer() -> None:
    text = pooling_policy_yaml().replace(
        "serves: [embeddings, rerank]", "serves: [embeddings, rerank]\n    pooling_priority: high"
    )
    [issue] = _issues(text)
    assert issue.startswith(
        f"p.yaml:{_line(text, 'pooling_priority')}: pools.embed.pooling_priority:"
    )
    assert "integer" in issue
    assert policy_from_text(pooling_policy_yaml()).pools[EMBED_POOL].pooling_priority is None


@pytest.mark.parametrize(
    ("serves", "field", "message"),
    [
        ("[embeddings, images]", "pools.embed.serves.1", "Input should be 'chat'"),
        ("[rerank, rerank]", "pools.embed.serves", "an endpoint class is listed twice"),
        ("[]", "pools.embed.serves", "at least 1 item"),
        ("embeddings", "pools.embed.serves", "valid list"),
    ],
)
def test_serves_is_validated_strictly_with_file_and_line(
    serves: str, field: str, message: str
) -> None:
    text = pooling_policy_yaml().replace("serves: [embeddings, rerank]", f"serves: {serves}")
    [issue] = _issues(text)
    assert issue.startswith(f"p.yaml:{_line(text, 'serves:')}: {field}: ")
    assert message in issue
