"""Hypothesis-generated HTTP requests through the real Envoy: malformed JSON, wrong types, bad
UTF-8, oversized and chunked bodies, path and header tricks. Every answer must come in time,
never be a 5xx, and every error must carry the OpenAI error body as JSON.

Bounded: a fixed number of examples, one request at a time, loopback only."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.adversarial.raw_http import BODY_LIMIT, assert_openai_error, build_request, send_raw
from tests.conftest import TEST_KEYS
from tests.dataplane.harness import RunningGateway

pytestmark = pytest.mark.dataplane

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)

PATHS = st.sampled_from(
    [
        "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/chat/complet%69ons",
        "/v1//completions", "/v1/./chat/completions", "/v1/chat/completions?stream=true",
        "/v1%2Fcompletions", "/metrics", "/health", "/tokenize", "/v1/embeddings",
        "/%2e%2e/metrics", "/v1/chat/completions/..", "/" + "a" * 2000,
    ]
) | st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#"),
    max_size=60,
).map(lambda tail: "/" + tail)  # fmt: skip

METHODS = st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"])

AUTH = st.sampled_from(
    [
        [("authorization", f"Bearer {TEST_KEYS['globex']}")],
        [("authorization", f"Bearer {TEST_KEYS['acme']}")],
        [("x-api-key", TEST_KEYS["initech"])],
        [("authorization", "Bearer not-a-key")],
        [("authorization", "Basic Zm9vOmJhcg==")],
        [("authorization", f"Bearer {TEST_KEYS['globex']}"), ("authorization", "Bearer x")],
        [],
    ]
)

EXTRA_HEADERS = st.lists(
    st.sampled_from(
        [
            ("content-type", "application/json"),
            ("content-type", "text/plain"),
            ("content-type", "application/json; charset=latin-1"),
            ("x-llm-pool", "long"),
            ("x-tenant-id", "acme"),
            ("x-tier", "premium"),
            ("x-priority", "999999999999999999999"),
            ("x-priority", "-5"),
            ("x-gateway-request-id", "spoofed"),
            ("x-request-id", "\x7f"),
            ("accept-encoding", "gzip"),
            ("expect", "100-continue"),
            ("x-long", "v" * 8000),
        ]
    ),
    max_size=4,
)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
MESSAGES = st.dictionaries(st.sampled_from(["role", "content"]), JSON_VALUES)
MAX_TOKENS = st.sampled_from([None, -1, 0, 1, 4, "8", 1.5, True, 10**12, [], {}])


@st.composite
def chat_like(draw: st.DrawFn) -> bytes:
    """A chat or completions body with some fields of the wrong type or shape."""
    body: dict[str, object] = {
        "model": draw(st.sampled_from(["m", "", None, 7, ["m"], "x" * 300])),
        "messages": draw(
            st.sampled_from([[{"role": "user", "content": "hi"}], [], None, "hi", [{}]])
            | st.lists(
                st.dictionaries(st.sampled_from(["role", "content"]), JSON_VALUES), max_size=3
            )
        ),
        "prompt": draw(st.sampled_from(["once", ["a", "b"], None, 5, [[1, 2]]])),
        "stream": draw(st.sampled_from([False, True, "yes", None])),
        "stream_options": draw(st.sampled_from([None, {"include_usage": True}, [], "x"])),
    }
    max_tokens = draw(MAX_TOKENS)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(draw(st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=3)))
    # json, not orjson: integers beyond 64 bits are part of the point.
    return json.dumps(body).encode()


BODIES = st.one_of(
    chat_like(),
    st.binary(max_size=300),
    st.sampled_from(
        [
            b"",
            b"{",
            b"null",
            b"[]",
            b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
            b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
            b'{"model": "m", "model": 1}',
            b"{" * 10000 + b"}" * 10000,
            b'{"model": "m", "messages": [{"role": "user", "content": "'
            + b"y" * (2 * BODY_LIMIT)
            + b'"}]}',
        ]
    ),
)


@given(
    method=METHODS,
    path=PATHS,
    auth=AUTH,
    headers=EXTRA_HEADERS,
    body=BODIES,
    chunked=st.booleans(),
)
@FUZZ
def test_no_5xx_no_hang_and_openai_errors(
    gateway: RunningGateway,
    method: str,
    path: str,
    auth: list[tuple[str, str]],
    headers: list[tuple[str, str]],
    body: bytes,
    chunked: bool,
) -> None:
    sent = None if method in ("GET", "DELETE", "OPTIONS") and not body else body
    request = build_request(method, path, [*auth, *headers], sent, chunked)
    answer = send_raw(gateway, request, method)
    assert answer.status < 500, (method, path, answer)
    if answer.status >= 400:
        assert_openai_error(answer)
