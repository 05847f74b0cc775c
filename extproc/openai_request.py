"""Validate an inference request body and pull out what admission needs: chat and completions
here, the pooling endpoints (embeddings, rerank, score) in `extproc.pooling_request`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson

from extproc.endpoints import ENDPOINTS, POOLING_CLASSES, EndpointClass
from extproc.errors import bad_request
from extproc.pooling_request import PoolingPrompt, embeddings_prompt, rerank_prompt, score_prompt
from extproc.prompt import PromptParts

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
RERANK_PATH = "/v1/rerank"
SCORE_PATH = "/v1/score"
INFERENCE_PATHS = tuple(ENDPOINTS)
MODELS_PATH = "/v1/models"
# An encoded slash or backslash changes the path's segments once decoded: refused, as Envoy
# does with `path_with_escaped_slashes_action: REJECT_REQUEST`.
_ENCODED_SEPARATOR = re.compile("%(2f|5c)", re.IGNORECASE)


__all__ = ["InferenceRequest", "PromptParts", "parse_inference_request"]


@dataclass
class InferenceRequest:
    path: str
    endpoint: EndpointClass
    body: dict[str, Any]
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    prompt: PromptParts
    """max_tokens is None and stream False for the pooling classes: they have no output."""
    longest_input: PromptParts | None = None
    """Pooling classes: the longest single input, which routing fits to a pool (each input is
    a sequence of its own); None: the whole prompt is one sequence."""


def _content_text(content: Any, where: str) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise bad_request(f"{where}: each content part must be an object")
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
        return texts
    raise bad_request(f"{where}: content must be a string or a list of parts")


def _chat_prompt(body: dict[str, Any]) -> PromptParts:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty array", "missing_field")
    parts = PromptParts(messages=len(messages))
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object")
        if not isinstance(message.get("role"), str):
            raise bad_request(f"{where}.role is required and must be a string", "missing_field")
        parts.texts.extend(_content_text(message.get("content"), where))
        if message.get("tool_calls") is not None:
            parts.texts.append(orjson.dumps(message["tool_calls"]).decode())
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be an array")
        parts.tools = len(tools)
        parts.tools_json = orjson.dumps(tools).decode() if tools else ""
    return parts


def _completion_prompt(body: dict[str, Any]) -> PromptParts:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return PromptParts(texts=[prompt])
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return PromptParts(texts=list(prompt))
    raise bad_request(
        "'prompt' is required and must be a string or an array of strings", "missing_field"
    )


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{name}' must be a positive integer")
    return value


def _pooling_prompt(path: str, body: dict[str, Any]) -> PoolingPrompt:
    if path == EMBEDDINGS_PATH:
        return embeddings_prompt(body, _chat_prompt)
    if path == RERANK_PATH:
        return rerank_prompt(body)
    return score_prompt(body)


def parse_inference_request(path: str, raw: bytes) -> InferenceRequest:
    """Parse and validate; raises GatewayError (400) with a message naming the problem."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "missing_field")
    endpoint = ENDPOINTS[path]
    if endpoint in POOLING_CLASSES:
        pooling = _pooling_prompt(path, body)
        return InferenceRequest(
            path, endpoint, body, model, False, False, None, pooling.prompt, pooling.longest
        )
    prompt = _chat_prompt(body) if path == CHAT_PATH else _completion_prompt(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    return InferenceRequest(
        path=path,
        endpoint=endpoint,
        body=body,
        model=model,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        max_tokens=max_tokens,
        prompt=prompt,
    )


def normalise_path(path: str) -> str:
    """The path as the routes and the engines read it, without the query string: percent
    escapes decoded, backslashes as slashes, repeated slashes merged, `.` and `..` resolved
    (never above the root). Case is kept: Envoy's routes and the engines match it exactly.
    Raises GatewayError 400 for an encoded slash."""
    base = path.split("?", 1)[0].split("#", 1)[0]
    if _ENCODED_SEPARATOR.search(base):
        raise bad_request("the path contains an encoded slash", "invalid_path")
    decoded = unquote(base, errors="replace").replace("\\", "/")
    segments: list[str] = []
    for segment in decoded.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    trailing = "/" if decoded.endswith(("/", "/.", "/..")) and segments else ""
    return "/" + "/".join(segments) + trailing


def inference_path(path: str) -> str | None:
    """The inference endpoint a normalised path (normalise_path) names, if any."""
    return path if path in ENDPOINTS else None
