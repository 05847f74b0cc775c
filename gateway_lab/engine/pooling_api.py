"""The pooling endpoints of the emulated engine, as vLLM 0.32 serves them with an embedding
model (`--runner pooling --convert embed`): `/v1/embeddings`, `/v1/rerank` and `/v1/score`.

Each input becomes one engine request that is only prefilled (vLLM's pooling runner samples
nothing), and vLLM's counters count it so: `vllm:prompt_tokens` adds its tokens,
`vllm:request_success{finished_reason="stop"}` one per input, `vllm:generation_tokens`
nothing. Rerank and score embed every text once (a bi-encoder: the query once, then each
document) and `usage.prompt_tokens` is their sum, which is what the real engine answers
(tests/vllm). Vectors and scores are deterministic functions of the text, of no meaning.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any, Literal

from gateway_lab.engine.openai_api import ApiError, priority_field
from gateway_lab.engine.tokens import PromptError, chat_prompt_tokens, text_tokens

PoolingKind = Literal["embeddings", "rerank", "score"]
EMBEDDING_SIZE = 16
_SCORE_SIDES = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)


@dataclass(frozen=True, slots=True)
class PoolingParams:
    kind: PoolingKind
    model: str
    req_id: str
    created: int
    texts: tuple[str, ...]
    """One per engine request: the text embedded (a token-id input shows as its ids)."""
    tokens: tuple[int, ...]
    """Prompt tokens of each engine request."""
    first: int
    """Rerank / score: how many of `texts` are the first side (the query)."""
    encoding_format: str = "float"
    top_n: int = 0
    priority: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(self.tokens)


def _embedding_inputs(body: dict[str, Any]) -> list[tuple[str, int]]:
    if "input" not in body and "messages" in body:
        try:
            return [("messages", chat_prompt_tokens(body.get("messages")))]
        except PromptError as exc:
            raise ApiError(400, str(exc), param="messages") from None
    value = body.get("input")
    if isinstance(value, str):
        return [(value, text_tokens(value))]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return [(item, text_tokens(item)) for item in value]
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return [(str(value), len(value))]
        if all(
            isinstance(item, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
            for item in value
        ):
            return [(str(item), len(item)) for item in value]
    raise ApiError(
        400,
        "'input' must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids",
        param="input",
    )


def _score_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        return "\n".join(
            part["text"]
            for part in value["content"]
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    raise ApiError(400, f"'{where}' must be a string or an object with 'content'", param=where)


def _side(body: dict[str, Any], name: str) -> list[str]:
    value = body.get(name)
    if value is None:
        raise ApiError(400, f"Field required: {name}", param=name)
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ApiError(400, f"'{name}' must not be empty", param=name)
    return [_score_text(item, f"{name}[{i}]") for i, item in enumerate(items)]


def _scoring_inputs(kind: PoolingKind, body: dict[str, Any]) -> tuple[list[str], list[str]]:
    if kind == "rerank":
        if body.get("query") is None:
            raise ApiError(400, "Field required: query", param="query")
        return [_score_text(body["query"], "query")], _side(body, "documents")
    for left, right in _SCORE_SIDES:
        if left in body or right in body:
            first, second = _side(body, left), _side(body, right)
            if len(first) != 1 and len(first) != len(second):
                raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
            return first, second
    raise ApiError(400, "Field required: text_1, text_2", param="text_1")


def parse_pooling_request(
    kind: PoolingKind,
    body: dict[str, Any],
    *,
    model: str,
    strict_model: bool,
    max_model_len: int,
) -> PoolingParams:
    """The engine requests a pooling call makes, validated as vLLM does."""
    asked = body.get("model")
    if asked is not None and asked != model and strict_model:
        raise ApiError(404, f"The model `{asked}` does not exist.", "NotFoundError", "model")
    first = 0
    if kind == "embeddings":
        inputs = _embedding_inputs(body)
    else:
        left, right = _scoring_inputs(kind, body)
        first = len(left)
        inputs = [(text, text_tokens(text)) for text in left + right]
    for _, tokens in inputs:
        if tokens < 1:
            raise ApiError(400, "The prompt must not be empty.", param="input")
        if tokens > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {tokens} tokens in the input for embedding generation. "
                "Please reduce the length of the input.",
            )
    encoding = body.get("encoding_format", "float")
    if kind == "embeddings" and encoding not in ("float", "base64"):
        raise ApiError(
            400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
        )
    top_n = body.get("top_n", 0)
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise ApiError(400, "'top_n' must be a non-negative integer", param="top_n")
    prefix = "embd-" if kind == "embeddings" else "score-"
    return PoolingParams(
        kind=kind,
        model=model,
        req_id=prefix + uuid.uuid4().hex[:16],
        created=int(time.time()),
        texts=tuple(text for text, _ in inputs),
        tokens=tuple(tokens for _, tokens in inputs),
        first=first,
        encoding_format=str(encoding),
        top_n=top_n,
        priority=priority_field(body),
    )


def _unit(text: str, salt: int) -> float:
    """A deterministic number in [0, 1) from a text."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"), salt) / 2**32


def _vector(text: str) -> list[float]:
    return [round(_unit(text, i) * 2 - 1, 6) for i in range(EMBEDDING_SIZE)]


def _usage(params: PoolingParams) -> dict[str, Any]:
    """vLLM's UsageInfo of a pooling response (no completion)."""
    n = params.prompt_tokens
    return {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _scores(params: PoolingParams) -> list[float]:
    """One score per pair: the first side broadcast over the second."""
    left, right = params.texts[: params.first], params.texts[params.first :]
    if len(left) == 1:
        left = left * len(right)
    return [_unit(a + "\0" + b, 7) for a, b in zip(left, right, strict=True)]


def response_body(params: PoolingParams) -> dict[str, Any]:
    """The JSON body vLLM answers a pooling call with."""
    if params.kind == "embeddings":
        data = []
        for index, text in enumerate(params.texts):
            vector = _vector(text)
            embedding: list[float] | str = vector
            if params.encoding_format == "base64":
                raw = struct.pack(f"<{len(vector)}f", *vector)
                embedding = base64.b64encode(raw).decode()
            data.append({"index": index, "object": "embedding", "embedding": embedding})
        return {
            "id": params.req_id,
            "object": "list",
            "created": params.created,
            "model": params.model,
            "data": data,
            "usage": _usage(params),
        }
    scores = _scores(params)
    if params.kind == "score":
        return {
            "id": params.req_id,
            "object": "list",
            "created": params.created,
            "model": params.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(params),
        }
    documents = params.texts[params.first :]
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    if params.top_n:
        ranked = ranked[: params.top_n]
    results = [
        {
            "index": i,
            "document": {"text": documents[i], "multi_modal": None},
            "relevance_score": scores[i],
        }
        for i in ranked
    ]
    usage = {"prompt_tokens": params.prompt_tokens, "total_tokens": params.prompt_tokens}
    return {"id": params.req_id, "model": params.model, "usage": usage, "results": results}
