"""The OpenAI-compatible request and response shapes of the emulated engine, as vLLM's server
has them: request validation (`parse_request`, `ApiError` with vLLM's error body), the whole
response body, and the SSE events of a streamed one."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
import pydantic
from aiohttp import web
from aiohttp.typedefs import Handler

from gateway_lab.engine.tokens import (
    PromptError,
    chat_prompt_token_ids,
    completion_prompt_token_ids,
    output_piece,
    output_text,
)

MAX_BODY_BYTES = 64 * 1024 * 1024


class ApiError(Exception):
    """An error answered with vLLM's (OpenAI's) JSON error body."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }
        return web.Response(
            status=self.status, body=orjson.dumps(body), content_type="application/json"
        )


@dataclass(frozen=True, slots=True)
class Params:
    """What a request asks for, once validated."""

    chat: bool
    model: str
    """The served model name the response carries."""
    req_id: str
    created: int
    prompt_tokens: int
    prompt_token_ids: list[int]
    """The prompt's token ids (the emulator's rule in `tokens.py`), for prefix caching."""
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    priority: int
    """vLLM's request priority (lower first); the engine ignores it under "fcfs"."""


# vLLM's request models declare `priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)`,
# validated by pydantic in lax mode: "3", 3.0 and true are accepted as 3, 3, 1.
_PRIORITY = pydantic.TypeAdapter(
    Annotated[int, pydantic.Field(ge=-(2**63), le=2**63 - 1)]  # type: ignore[call-overload]
)


def _shown_input(value: object) -> str:
    """The offending value as vLLM's handler echoes it: text, cut at 200 characters."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def priority_field(body: dict[str, Any]) -> int:
    """The request's `priority`, or ApiError with the body vLLM's validation handler sends."""
    if "priority" not in body:
        return 0
    try:
        return int(_PRIORITY.validate_python(body["priority"]))
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False)
        lines = []
        for error in errors:
            shown = dict(error)
            shown["loc"] = "body.priority"
            shown["input"] = _shown_input(shown["input"])
            lines.append(f"  {shown}\n")
        label = "error" if len(errors) == 1 else "errors"
        message = (f"{len(errors)} validation {label}:\n" + "".join(lines)).rstrip()
        raise ApiError(400, message, "Bad Request", "body.priority") from None


def int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    return value


def parse_request(
    body: dict[str, Any],
    chat: bool,
    *,
    model: str,
    strict_model: bool,
    max_model_len: int,
    default_max_tokens: int,
) -> Params:
    """The request's parameters, validated as vLLM does (ApiError when vLLM would refuse)."""
    asked = body.get("model")
    if asked is not None and asked != model and strict_model:
        raise ApiError(404, f"The model `{asked}` does not exist.", "NotFoundError", "model")
    try:
        if chat:
            token_ids = chat_prompt_token_ids(body.get("messages"), body.get("tools"))
        else:
            token_ids = completion_prompt_token_ids(body.get("prompt"))
    except PromptError as exc:
        raise ApiError(400, str(exc)) from None
    prompt_tokens = len(token_ids)
    if prompt_tokens < 1:
        raise ApiError(400, "The prompt must not be empty.", param="prompt")

    limit = max_model_len
    max_tokens = int_field(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens")
    if prompt_tokens >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request "
            f"has {prompt_tokens} input tokens. Please reduce the length of the input "
            "messages.",
        )
    if max_tokens is None:
        max_tokens = min(default_max_tokens, limit - prompt_tokens)
    elif max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    elif prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{max_tokens} output tokens and your prompt contains at least {prompt_tokens} "
            f"input tokens, for a total of at least {prompt_tokens + max_tokens} tokens. "
            "Please reduce the length of the input prompt or the number of requested output "
            "tokens.",
            param="max_tokens",
        )
    min_tokens = int_field(body, "min_tokens") or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens must be between 0 and max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")

    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise ApiError(
                400,
                "Stream options can only be defined when `stream=True`.",
                param="stream_options",
            )
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        include_usage = options.get("include_usage") is True
        continuous_usage = include_usage and options.get("continuous_usage_stats") is True
    priority = priority_field(body)
    prefix = "chatcmpl-" if chat else "cmpl-"
    return Params(
        chat=chat,
        model=model,
        req_id=prefix + uuid.uuid4().hex,
        created=int(time.time()),
        prompt_tokens=prompt_tokens,
        prompt_token_ids=token_ids,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        priority=priority,
    )


def usage_of(params: Params, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": params.prompt_tokens,
        "total_tokens": params.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def full_body(params: Params) -> dict[str, Any]:
    text = output_text(params.max_tokens)
    choice: dict[str, Any]
    if params.chat:
        choice = {
            "index": 0,
            "message": {
                "role": "assistant",
                "reasoning_content": None,
                "content": text,
                "tool_calls": [],
            },
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    return {
        "id": params.req_id,
        "object": "chat.completion" if params.chat else "text_completion",
        "created": params.created,
        "model": params.model,
        "choices": [choice],
        "usage": usage_of(params, params.max_tokens),
        "prompt_logprobs": None,
    }


def token_event(params: Params, index: int, finish: bool) -> bytes:
    """One SSE event carrying output token `index`; the last one carries finish_reason."""
    choice: dict[str, Any]
    text = output_piece(index)
    if params.chat:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = "length" if finish else None
    if finish or not params.chat:
        choice["stop_reason"] = None
    counts = usage_of(params, index + 1) if params.continuous_usage else None
    return sse_event(params, [choice], counts)


def sse_event(params: Params, choices: list[Any], counts: dict[str, Any] | None) -> bytes:
    """One SSE event (a chunk object with `choices`, and `counts` as its usage if given)."""
    body: dict[str, Any] = {
        "id": params.req_id,
        "object": "chat.completion.chunk" if params.chat else "text_completion",
        "created": params.created,
        "model": params.model,
        "choices": choices,
    }
    if counts is not None:
        body["usage"] = counts
    return b"data: " + orjson.dumps(body) + b"\n\n"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, "The request body is too large.") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body
