from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.sse import (
    MAX_JSON_BODY_BYTES,
    EventKind,
    JsonUsageParser,
    SseUsageParser,
    Usage,
    _fast_event,
    _parse_event,
    is_event_stream,
    parse_json_usage,
)

BASE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def event(body: Any, eol: bytes = b"\n") -> bytes:
    return b"data: " + orjson.dumps(body) + eol + eol


def chunk(content: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**BASE, "choices": [choice], **extra}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def vllm_stream(
    tokens: int, prompt: int = 7, eol: bytes = b"\n", final_usage: bool = True
) -> bytes:
    role = {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    out = event(role, eol)
    for i in range(tokens):
        out += event(chunk(f" w{i}", "length" if i == tokens - 1 else None), eol)
    if final_usage:
        out += event({**BASE, "choices": [], "usage": usage(prompt, tokens)}, eol)
    return out + b"data: [DONE]" + eol + eol


def feed_all(parts: list[bytes]) -> SseUsageParser:
    parser = SseUsageParser()
    for part in parts:
        parser.feed(part)
    return parser


def outcome(parser: SseUsageParser) -> tuple[Any, ...]:
    return (
        parser.usage,
        parser.done,
        parser.deltas_seen,
        parser.output_tokens_seen,
        parser.finish_reason,
        parser.events_seen,
        parser.malformed,
        parser.error,
    )


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(max(c, 0), len(data)) for c in cuts})
    parts, last = [], 0
    for point in points:
        parts.append(data[last:point])
        last = point
    parts.append(data[last:])
    return parts


def test_whole_vllm_stream() -> None:
    parser = SseUsageParser()
    events = parser.feed(vllm_stream(5))
    assert parser.usage == Usage(7, 5, 12)
    assert parser.usage.total == 12
    assert parser.done
    assert parser.deltas_seen == 5
    assert parser.output_tokens_seen == 5
    assert parser.finish_reason == "length"
    assert [e.kind for e in events].count(EventKind.DONE) == 1
    assert parser.malformed == 0


def test_counts_before_usage_then_usage_wins() -> None:
    parser = SseUsageParser()
    parser.feed(event(chunk("a")) + event(chunk("b")) + event(chunk("")))
    assert parser.output_tokens_seen == 2 and parser.usage is None
    # The engine's count differs (a chunk held two tokens): usage replaces the count.
    parser.feed(event({**BASE, "choices": [], "usage": usage(3, 3)}))
    assert parser.output_tokens_seen == 3
    assert not parser.done
    parser.feed(b"data: [DONE]\n\n")
    assert parser.done


def test_continuous_usage_stats() -> None:
    parser = SseUsageParser()
    for i in range(4):
        parser.feed(event(chunk(f"t{i}", usage=usage(9, i + 1))))
        assert parser.output_tokens_seen == i + 1
    assert parser.usage == Usage(9, 4, 13)
    assert parser.deltas_seen == 4


def test_byte_at_a_time_with_crlf() -> None:
    data = vllm_stream(3, eol=b"\r\n")
    parser = feed_all([data[i : i + 1] for i in range(len(data))])
    assert parser.usage == Usage(7, 3, 10) and parser.done and parser.deltas_seen == 3


def test_cr_only_line_ends_and_comments() -> None:
    data = b": keep-alive\r" + vllm_stream(2).replace(b"\n", b"\r")
    parser = feed_all([data])
    assert parser.usage == Usage(7, 2, 9) and parser.done


def test_multi_line_data_field() -> None:
    body = orjson.dumps({**BASE, "choices": [], "usage": usage(4, 2)}, option=orjson.OPT_INDENT_2)
    lines = b"\n".join(b"data: " + line for line in body.split(b"\n"))
    parser = feed_all([lines + b"\n\n"])
    assert parser.usage == Usage(4, 2, 6)


def test_garbage_is_counted_and_skipped() -> None:
    data = (
        b"data: {not json\n\n"
        b"data: 42\n\n"
        b"nonsense line without colon\n\n"
        b"event: ping\n\n"
        b"data:\n\n"
        + b"data: \xff\xfe\x00\n\n"
        + event(chunk("x"))
        + event({**BASE, "choices": [], "usage": {"prompt_tokens": "many"}})
        + event({**BASE, "choices": [], "usage": usage(1, 1)})
    )
    parser = feed_all([data])
    assert parser.malformed == 4
    assert parser.usage == Usage(1, 1, 2)
    assert parser.deltas_seen == 1


def test_error_event() -> None:
    parser = SseUsageParser()
    events = parser.feed(event({"error": {"message": "boom", "code": 500}}))
    assert events[0].kind is EventKind.ERROR and parser.error == "boom"
    parser.feed(b'event: error\ndata: {"object": "error", "message": "overloaded"}\n\n')
    assert parser.error == "overloaded"
    parser.feed(b"event: error\ndata: plain text\n\n")
    assert parser.error == "plain text"


def test_usage_null_on_every_chunk_openai_style() -> None:
    parser = SseUsageParser()
    parser.feed(event(chunk("hi", usage=None)) + event(chunk("there", usage=None)))
    assert parser.output_tokens_seen == 2 and parser.usage is None
    parser.feed(event({**BASE, "choices": [], "usage": usage(5, 2)}))
    assert parser.usage == Usage(5, 2, 7)


def test_tool_calls_and_completions_text_and_reasoning() -> None:
    tool = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    tool_chunk = {**BASE, "choices": [{"index": 0, "delta": {"tool_calls": [tool]}}]}
    text_chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ab"}]}
    reasoning = {**BASE, "choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}
    parser = feed_all([event(tool_chunk) + event(text_chunk) + event(reasoning)])
    assert parser.deltas_seen == 3 and parser.output_tokens_seen == 3


def test_close_flushes_an_unterminated_event() -> None:
    parser = SseUsageParser()
    parser.feed(b"data: " + orjson.dumps({**BASE, "choices": [], "usage": usage(2, 2)}))
    assert parser.usage is None
    parser.close()
    assert parser.usage == Usage(2, 2, 4)


def test_cached_tokens() -> None:
    body = {"choices": [], "usage": {**usage(10, 1), "prompt_tokens_details": {"cached_tokens": 8}}}
    assert parse_json_usage(orjson.dumps(body)) == Usage(10, 1, 11, cached_tokens=8)


REALISTIC = [
    chunk("hello"),
    chunk(""),
    chunk(None, "stop"),
    chunk('quote " and \\ backslash'),
    chunk('"usage"'),
    chunk("error"),
    chunk('content":"x'),
    chunk(" tok", usage=None),
    chunk(" tok", usage=usage(3, 4)),
    {**BASE, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {**BASE, "choices": [{"index": 0, "delta": {"content": None, "reasoning_content": "r"}}]},
    {
        **BASE,
        "choices": [
            {"index": 0, "delta": {"content": "a"}},
            {"index": 1, "delta": {"content": "b"}},
        ],
    },
    {
        "id": "c",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
    },
    {
        "id": "c",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "x", "logprobs": None}],
    },
    {**BASE, "choices": [], "usage": usage(5, 6)},
    {**BASE, "choices": [{"index": 0, "delta": {"content": "ü漢字"}, "finish_reason": "length"}]},
]


@pytest.mark.parametrize("body", REALISTIC)
def test_fast_path_agrees_with_parser(body: dict[str, Any]) -> None:
    payload = orjson.dumps(body)
    fast = _fast_event(payload)
    slow = _parse_event(payload)
    if fast is not None:
        assert fast == slow
    spaced = orjson.dumps(body, option=orjson.OPT_INDENT_2)
    assert _fast_event(spaced) is None or _fast_event(spaced) == slow


def test_fast_path_is_taken_for_plain_deltas() -> None:
    assert _fast_event(orjson.dumps(chunk("x"))) is not None
    assert _fast_event(orjson.dumps({**BASE, "choices": [], "usage": usage(1, 1)})) is None


# -- split invariance ----------------------------------------------------------------------


def stream_strategy() -> st.SearchStrategy[bytes]:
    piece = st.one_of(
        st.builds(lambda t: event(chunk(t)), st.text(max_size=8)),
        st.builds(
            lambda p, c: event({**BASE, "choices": [], "usage": usage(p, c)}),
            st.integers(0, 10_000),
            st.integers(0, 10_000),
        ),
        st.builds(
            lambda t, p, c: event(chunk(t, usage=usage(p, c))),
            st.text(max_size=4),
            st.integers(0, 99),
            st.integers(0, 99),
        ),
        st.just(b": comment\n\n"),
        st.just(b"data: [DONE]\n\n"),
        st.just(b"data: {broken\n\n"),
        st.just(event({"error": {"message": "bad"}})),
        st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"") + b"\n\n"),
    )
    return st.builds(
        lambda pieces, eol: (
            b"".join(pieces).replace(b"\n", eol) if eol != b"\n" else b"".join(pieces)
        ),
        st.lists(piece, max_size=12),
        st.sampled_from([b"\n", b"\r\n", b"\r"]),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=stream_strategy(), cuts=st.lists(st.integers(0, 4000), max_size=20))
def test_any_split_gives_the_same_result(data: bytes, cuts: list[int]) -> None:
    whole = feed_all([data])
    whole.close()
    split = feed_all(split_at(data, cuts))
    split.close()
    assert outcome(split) == outcome(whole)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 30),
    cuts=st.lists(st.integers(0, 3000), max_size=30),
    eol=st.sampled_from([b"\n", b"\r\n"]),
)
def test_vllm_stream_any_split(tokens: int, cuts: list[int], eol: bytes) -> None:
    parser = feed_all(split_at(vllm_stream(tokens, eol=eol), cuts))
    assert parser.usage == Usage(7, tokens, 7 + tokens)
    assert parser.done and parser.deltas_seen == tokens and parser.output_tokens_seen == tokens


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=10))
def test_never_raises_on_garbage(data: bytes, cuts: list[int]) -> None:
    parser = feed_all(split_at(data, cuts))
    parser.close()
    assert parser.output_tokens_seen >= 0


# -- non-streamed JSON ---------------------------------------------------------------------


def completion_body(prompt: int = 11, completion: int = 3) -> bytes:
    message = {"role": "assistant", "content": "x" * 50}
    return orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message}],
            "usage": usage(prompt, completion),
        }
    )


def test_parse_json_usage() -> None:
    assert parse_json_usage(completion_body()) == Usage(11, 3, 14)
    assert parse_json_usage(b"not json") is None
    assert parse_json_usage(b"[1, 2]") is None
    assert parse_json_usage(b'{"error": {"message": "x"}}') is None
    assert parse_json_usage(b'{"usage": {"prompt_tokens": 2}}') == Usage(2, 0, 2)
    # A cut body still yields the usage object if it is complete.
    assert parse_json_usage(completion_body()[:-1]) == Usage(11, 3, 14)


@given(cuts=st.lists(st.integers(0, 400), max_size=10))
def test_json_parser_accumulates_chunks(cuts: list[int]) -> None:
    parser = JsonUsageParser()
    for part in split_at(completion_body(), cuts):
        parser.feed(part)
    assert parser.finish() == Usage(11, 3, 14)


def test_json_parser_huge_body_keeps_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("extproc.sse.MAX_JSON_BODY_BYTES", 100)
    assert MAX_JSON_BODY_BYTES > 100
    body = completion_body()
    parser = JsonUsageParser()
    for i in range(0, len(body), 7):
        parser.feed(body[i : i + 7])
    assert parser.finish() == Usage(11, 3, 14)
    assert parser.bytes_seen == len(body)


def test_is_event_stream() -> None:
    assert is_event_stream("text/event-stream; charset=utf-8")
    assert not is_event_stream("application/json")


def test_endless_event_is_dropped() -> None:
    parser = SseUsageParser()
    parser.feed(b"data: x\n" * 5000)
    assert parser.malformed == 1
    parser.feed(b"\n" + event({**BASE, "choices": [], "usage": usage(1, 2)}))
    assert parser.usage == Usage(1, 2, 3)
