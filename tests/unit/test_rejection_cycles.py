"""A rejected request leaves no reference cycle behind (extproc/service/processor.py,
`_reject`): the error it keeps for the status page would otherwise hold, through its
traceback, the stream's frame and with it the request, which only a full garbage collection
frees, with the event loop stopped."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import orjson
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingResponse,
)

from extproc.policy import policy_from_text
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.processor import AdmissionProcessor, http_headers
from extproc.service.request import Request
from tests.conftest import TEST_KEYS, policy_yaml


@pytest.fixture
def gateway() -> Gateway:
    return compose(policy_from_text(policy_yaml()))


@pytest.fixture
def cyclic_garbage() -> Iterator[list[object]]:
    """What the collector finds unreachable from here on (kept in `gc.garbage`, not freed)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _headers(key: str, length: int = 10) -> HttpHeaders:
    return http_headers([
        (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gateway"),
        ("authorization", f"Bearer {key}"), ("content-type", "application/json"),
        ("content-length", str(length)),
    ])  # fmt: skip


async def _body_replies(admission: AdmissionProcessor, body: HttpBody) -> list[ProcessingResponse]:
    return [reply async for reply in admission.on_request_body(body)]


def _ours(garbage: list[object]) -> list[object]:
    return [o for o in garbage if isinstance(o, (AdmissionProcessor, Request))]


def test_an_unknown_key_leaves_no_cycle(gateway: Gateway, cyclic_garbage: list[object]) -> None:
    admission = AdmissionProcessor(gateway)
    reply = admission.on_request_headers(_headers("sk-unknown"))
    assert reply is not None and reply.immediate_response.status.code == 401
    assert admission.state.error is not None  # still kept for the status page
    admission.finish()
    del admission, reply
    gc.collect()
    assert _ours(cyclic_garbage) == []


def test_a_rejected_body_leaves_no_cycle(gateway: Gateway, cyclic_garbage: list[object]) -> None:
    body = orjson.dumps({"model": "m", "messages": "not a list"})
    admission = AdmissionProcessor(gateway)
    first = admission.on_request_headers(_headers(TEST_KEYS["acme"], len(body)))
    assert first is not None and not first.HasField("immediate_response")

    replies = asyncio.run(_body_replies(admission, HttpBody(body=body, end_of_stream=True)))
    assert replies[-1].immediate_response.status.code == 400
    admission.finish()
    del admission, replies, first
    gc.collect()
    assert _ours(cyclic_garbage) == []
