"""Token usage from OpenAI / vLLM responses: streamed (SSE) or one JSON body.

`SseUsageParser` is pure and incremental: `feed` takes response body chunks exactly as they
arrive (an event may be split at any byte, lines may end with LF, CRLF or CR) and keeps only
the unfinished line between calls, so no byte is scanned twice. For each complete event it
counts generated output and picks up usage:

- usage is cumulative: the last `usage` object seen wins. That is the final usage chunk
  (``{"choices": [], "usage": {...}}`` with ``stream_options.include_usage``) or, with vLLM's
  ``continuous_usage_stats``, the usage every chunk carries.
- a chunk whose choices carry non-empty ``delta.content`` / ``text`` / ``tool_calls`` /
  reasoning counts one generated token per such choice (vLLM streams about one token per
  chunk), unless it carries usage, whose ``completion_tokens`` then replaces the count:
  `output_tokens_seen` is the last usage's completion_tokens plus the deltas seen after it.
- ``data: [DONE]`` sets `done`.

Chunks that cannot hold usage or an error (no ``"usage"`` key with a value, no ``"error"``, no
``"tool_calls"``) in compact JSON (as vLLM and OpenAI send) are counted from a few substring
counts without being JSON-parsed; every other event is parsed with orjson. Nothing here raises
on bad input: a malformed event is counted in `malformed` and skipped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson

MAX_LINE_BYTES = 4 * 1024 * 1024  # a longer SSE line is dropped (and counted as malformed)
MAX_DATA_LINES = 4096  # an event with more data lines is dropped (and counted as malformed)
MAX_JSON_BODY_BYTES = 32 * 1024 * 1024  # a longer JSON body keeps only its tail
_TAIL_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens

    @property
    def total(self) -> int:
        return self.total_tokens


class EventKind(enum.Enum):
    CHUNK = "chunk"  # a data event with a JSON object (deltas and/or usage)
    DONE = "done"  # data: [DONE]
    ERROR = "error"  # an error object in the stream
    MALFORMED = "malformed"  # data that is not a JSON object (skipped)


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    deltas: int = 0  # choices in this event that carry generated output
    usage: Usage | None = None
    finish_reason: str | None = None
    error: str | None = None


def _int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, float) and value >= 0 and value.is_integer():
        return int(value)
    return None


def usage_from(value: Any) -> Usage | None:
    """A `Usage` from an OpenAI usage object; None if it is missing or malformed."""
    if not isinstance(value, dict):
        return None
    prompt = _int(value.get("prompt_tokens"))
    if prompt is None:
        return None
    completion = _int(value.get("completion_tokens"))
    if completion is None:
        completion = 0
    total = _int(value.get("total_tokens"))
    if total is None:
        total = prompt + completion
    cached = None
    details = value.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = _int(details.get("cached_tokens"))
    return Usage(prompt, completion, total, cached)


def _error_text(value: Any) -> str:
    if isinstance(value, dict):
        message = value.get("message")
        if isinstance(message, str):
            return message
    if isinstance(value, str):
        return value
    return "error"


def _generated(choice: Any) -> bool:
    """Does this streamed choice carry generated output?"""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                return True
        if delta.get("tool_calls"):
            return True
    text = choice.get("text")
    return isinstance(text, str) and bool(text)


def _parse_event(payload: bytes) -> Event:
    """Slow path: parse one data payload (not [DONE]) with orjson."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return Event(EventKind.MALFORMED)
    if not isinstance(body, dict):
        return Event(EventKind.MALFORMED)
    if "error" in body and body["error"] is not None:
        return Event(EventKind.ERROR, error=_error_text(body["error"]))
    if body.get("object") == "error":
        return Event(EventKind.ERROR, error=_error_text(body))
    usage = usage_from(body.get("usage"))
    tokens = 0
    finish = None
    choices = body.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if _generated(choice):
                tokens += 1
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                finish = choice["finish_reason"]
    return Event(EventKind.CHUNK, tokens, usage, finish)


_FINISH = b'"finish_reason":"'
_EMPTY_CHUNK = Event(EventKind.CHUNK)
_ONE_DELTA = Event(EventKind.CHUNK, 1)


def _fast_event(payload: bytes) -> Event | None:
    """Count a compact chunk without parsing it; None when it needs the full parser.

    In compact JSON the bytes '"content":"' can only be a key followed by a non-null string
    (a quote inside a string is escaped), and '"content":""' an empty one; likewise "text" and
    the reasoning keys. '"usage"' not followed by ':null' means a usage object. Tool calls,
    errors and non-compact JSON (a space after the first key's colon) go to the parser.
    """
    if payload[:2] != b'{"' or payload[-1:] != b"}":
        return None
    colon = payload.find(b'":', 2)
    if colon < 0 or payload[colon + 2 : colon + 3] in (b" ", b"\n", b"\t", b"\r"):
        return None
    if b'"usage"' in payload and payload.count(b'"usage"') != payload.count(b'"usage":null'):
        return None
    if b'"tool_calls"' in payload or b'"error"' in payload:
        return None
    tokens = payload.count(b'content":"')  # "content" and "reasoning_content"
    if tokens:
        tokens -= payload.count(b'content":""')
    if b'"text":"' in payload:
        tokens += payload.count(b'"text":"') - payload.count(b'"text":""')
    if b'"reasoning":"' in payload:
        tokens += payload.count(b'"reasoning":"') - payload.count(b'"reasoning":""')
    if tokens > 1:  # one per choice, like the parser: a choice may have content and reasoning
        tokens = min(tokens, max(1, payload.count(b'"index":')))
    at = payload.rfind(_FINISH)
    if at < 0:
        return (
            _ONE_DELTA
            if tokens == 1
            else _EMPTY_CHUNK
            if tokens == 0
            else Event(EventKind.CHUNK, tokens)
        )
    start = at + len(_FINISH)
    end = payload.find(b'"', start)
    finish = payload[start:end].decode("utf-8", "replace") if end > start else None
    return Event(EventKind.CHUNK, tokens, None, finish)


class SseUsageParser:
    """Incremental parser of an OpenAI-style event stream; see the module docstring."""

    __slots__ = (
        "_buffer",
        "_counted_since_usage",
        "_data",
        "_event_type",
        "_skip_lf",
        "_usage_completion",
        "deltas_seen",
        "done",
        "error",
        "events_seen",
        "finish_reason",
        "malformed",
        "usage",
    )

    def __init__(self) -> None:
        self._buffer = bytearray()  # the unfinished last line
        self._skip_lf = False  # the previous chunk ended with CR: drop a leading LF
        self._data: list[bytes] = []  # data lines of the event being read
        self._event_type = b""
        self._usage_completion = 0
        self._counted_since_usage = 0
        self.usage: Usage | None = None
        self.done = False
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.events_seen = 0  # data events dispatched (including [DONE] and malformed ones)
        self.deltas_seen = 0  # events that carried generated output
        self.malformed = 0

    @property
    def output_tokens_seen(self) -> int:
        """Generated tokens so far: the last usage's completion_tokens plus one per output
        delta seen after it."""
        return self._usage_completion + self._counted_since_usage

    def feed(self, chunk: bytes) -> list[Event]:
        """Consume the next body chunk; return the events it completed."""
        if not chunk:
            return []
        if (
            chunk[:6] == b"data: "
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk[-1:] == b"\n"
            and not (self._buffer or self._data or self._skip_lf or self._event_type)
            and b"\r" not in chunk
        ):
            # The shape engines send: one whole single-line event per chunk. Same result as
            # the line loop below, without splitting.
            self._data.append(chunk[6:-2])
            event = self._dispatch()
            return [] if event is None else [event]
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
                if not chunk:
                    return []
        if b"\n" not in chunk and b"\r" not in chunk:
            if len(self._buffer) + len(chunk) > MAX_LINE_BYTES:
                self._buffer.clear()
                self.malformed += 1
                self._data.clear()
            else:
                self._buffer += chunk
            return []
        if self._buffer:
            self._buffer += chunk
            data = bytes(self._buffer)
            self._buffer.clear()
        else:
            data = chunk
        if b"\r" in data:
            if data[-1:] == b"\r":
                self._skip_lf = True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        tail = lines.pop()
        if tail:
            self._buffer += tail
        events: list[Event] = []
        for line in lines:
            if line[:5] == b"data:":
                self._data.append(line[6:] if line[5:6] == b" " else line[5:])
                if len(self._data) > MAX_DATA_LINES:  # no blank line for ages: not SSE
                    self._data.clear()
                    self.malformed += 1
            elif line:
                self._field(line)
            elif self._data or self._event_type:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
        return events

    def close(self) -> list[Event]:
        """The body ended: dispatch an event left without its closing blank line."""
        events: list[Event] = []
        if self._buffer:
            self._field(bytes(self._buffer))
            self._buffer.clear()
        if self._data:
            event = self._dispatch()
            if event is not None:
                events.append(event)
        return events

    def _field(self, line: bytes) -> None:
        if line[:5] == b"data:":
            value = line[5:]
            self._data.append(value[1:] if value[:1] == b" " else value)
        elif line[:1] == b":":
            return  # a comment (keep-alive)
        elif line[:6] == b"event:":
            self._event_type = line[6:].strip()
        # id:, retry: and unknown fields do not matter here

    def _dispatch(self) -> Event | None:
        data = self._data
        event_type = self._event_type
        self._event_type = b""
        if not data:
            return None
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        data.clear()
        self.events_seen += 1
        payload = payload.strip()
        if payload == b"[DONE]":
            self.done = True
            return Event(EventKind.DONE)
        event = None if event_type == b"error" else _fast_event(payload)
        if event is None:
            event = _parse_event(payload)
            if event_type == b"error" and event.kind is not EventKind.ERROR:
                text = payload.decode("utf-8", "replace")
                event = Event(EventKind.ERROR, error=text[:500])
        kind = event.kind
        if kind is EventKind.CHUNK:
            if event.usage is not None:
                self.usage = event.usage
                self._usage_completion = event.usage.completion_tokens
                self._counted_since_usage = 0
            elif event.deltas:
                self._counted_since_usage += event.deltas
            if event.deltas:
                self.deltas_seen += 1
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
        elif kind is EventKind.ERROR:
            self.error = event.error
        else:
            self.malformed += 1
        return event


def parse_json_usage(body: bytes) -> Usage | None:
    """Usage of a non-streamed JSON response; None if absent or the body is not JSON."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _usage_from_tail(body)
    if isinstance(value, dict):
        return usage_from(value.get("usage"))
    return None


def _usage_from_tail(body: bytes) -> Usage | None:
    """Find the last `"usage": {...}` object in a (possibly truncated) body and parse it."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    start = body.find(b"{", at)
    if start < 0 or body[at + 7 : start].strip() != b":":
        return None
    depth = 0
    for index in range(start, min(len(body), start + 4096)):
        byte = body[index]
        if byte == 0x7B:  # {
            depth += 1
        elif byte == 0x7D:  # }
            depth -= 1
            if depth == 0:
                try:
                    return usage_from(orjson.loads(body[start : index + 1]))
                except orjson.JSONDecodeError:
                    return None
    return None


class JsonUsageParser:
    """Accumulate a non-streamed JSON response body, then read its usage at the end.

    A body above MAX_JSON_BODY_BYTES keeps only its last 64 KB, where vLLM and OpenAI put
    ``usage``; it is then found by a bracket scan instead of a full parse.
    """

    __slots__ = ("_chunks", "_size", "_tail", "_truncated", "usage")

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._truncated = False
        self._tail = b""
        self.usage: Usage | None = None

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self._size += len(chunk)
        if not self._truncated and self._size <= MAX_JSON_BODY_BYTES:
            self._chunks.append(chunk)
            return
        if not self._truncated:
            self._truncated = True
            self._tail = b"".join(self._chunks)[-_TAIL_BYTES:]
            self._chunks.clear()
        self._tail = (self._tail + chunk)[-_TAIL_BYTES:]

    def finish(self) -> Usage | None:
        """Parse what was fed (once) and return its usage."""
        if self._truncated:
            self.usage = _usage_from_tail(self._tail)
        elif self._chunks:
            body = b"".join(self._chunks)
            self.usage = parse_json_usage(body)
        self._chunks.clear()
        self._tail = b""
        self._truncated = False
        return self.usage

    @property
    def bytes_seen(self) -> int:
        return self._size


def is_event_stream(content_type: str) -> bool:
    return "text/event-stream" in content_type.lower()
