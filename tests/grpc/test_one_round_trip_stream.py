"""One round trip: Envoy streams the body without waiting for the headers reply (`STREAMED`
body, `send_body_without_waiting_for_header_response`, said in the first message's
protocol_config). Played against the real gRPC server, as Envoy sends it: the headers and
every body chunk first, then the replies, in order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import grpc
import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)

from extproc.policy import policy_from_text
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.roles import ADMISSION_METADATA
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import (
    EnvoyPeer,
    body_message,
    chat_body,
    headers_message,
    response_ends,
    set_headers,
)
from tests.grpc_support import served_stub

BodyMode = ProcessingMode.BodySendMode
MAX_BODY = 4096


@pytest.fixture
async def service() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    text = policy_yaml(short_inflight=1) + f"gateway: {{max_body_bytes: {MAX_BODY}}}\n"
    gateway = compose(policy_from_text(text))
    async with served_stub(gateway) as stub:
        yield gateway, stub


def first(
    method: str = "POST",
    key: str | None = TEST_KEYS["globex"],
    mode: int = BodyMode.STREAMED,
    without_waiting: bool = True,
    eos: bool = False,
    extra: tuple[tuple[str, str], ...] = (),
) -> ProcessingRequest:
    """The stream's first message: the request headers, with how Envoy sends the body."""
    path = "/v1/models" if method == "GET" else "/v1/chat/completions"
    message = headers_message(method, path, key, extra, eos=eos)
    message.protocol_config.CopyFrom(
        ProtocolConfiguration(
            request_body_mode=mode,  # type: ignore[arg-type]
            send_body_without_waiting_for_header_response=without_waiting,
        )
    )
    return message


def chunks(body: bytes, parts: int) -> list[ProcessingRequest]:
    size = -(-len(body) // parts)
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return [
        ProcessingRequest(request_body=HttpBody(body=piece, end_of_stream=i == len(pieces) - 1))
        for i, piece in enumerate(pieces)
    ]


async def send_all(peer: EnvoyPeer, messages: list[ProcessingRequest]) -> None:
    for message in messages:
        await peer.outbox.put(message)


def streamed_chat(max_tokens: int = 16) -> bytes:
    body = orjson.loads(chat_body(max_tokens=max_tokens))
    body["stream"] = True
    return orjson.dumps(body)


async def test_the_headers_reply_waits_for_the_body_and_carries_the_route(service) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    peer = EnvoyPeer(stub)
    body = streamed_chat()
    await send_all(peer, [first(extra=(("x-llm-pool", "long"),)), *chunks(body, 3)])
    replies = [await peer.read() for _ in range(4)]
    headers, *earlier, last = replies
    # The pool comes from the body's budget: this reply could only be built once it was in.
    assert headers.WhichOneof("response") == "request_headers"
    values = set_headers(headers, "request_headers")
    assert values["x-llm-pool"] == "short" and values["x-tenant-id"] == "globex"
    assert "content-length" not in values  # Envoy sends a STREAMED body chunked
    assert headers.request_headers.response.clear_route_cache
    # The body grew (include_usage): the earlier chunks go empty, the last carries it all.
    for reply in earlier:
        assert reply.request_body.response.body_mutation.clear_body
    sent = orjson.loads(last.request_body.response.body_mutation.body)
    assert sent["stream_options"] == {"include_usage": True}
    metadata = last.dynamic_metadata.fields[ADMISSION_METADATA].struct_value.fields
    assert "x-gateway-queue-ms" in metadata
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 1


async def test_an_unchanged_body_passes_chunk_by_chunk() -> None:
    """Not streamed (no `include_usage` to add) and no engine priority to set."""
    text = policy_yaml().replace(
        "    max_inflight_tokens:", "    engine_priority: false\n    max_inflight_tokens:"
    )
    async with served_stub(compose(policy_from_text(text))) as stub:
        await unchanged_body_passes(stub)


async def unchanged_body_passes(stub: ext_proc_grpc.ExternalProcessorStub) -> None:
    peer = EnvoyPeer(stub)
    await send_all(peer, [first(), *chunks(chat_body(), 2)])
    replies = [await peer.read() for _ in range(3)]
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers",
        "request_body",
        "request_body",
    ]
    for reply in replies[1:]:
        assert not reply.request_body.response.HasField("body_mutation")
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK


async def test_a_wrong_key_is_answered_at_the_headers(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    peer = EnvoyPeer(stub)
    reply = await peer.send(first(key="wrong"))
    assert reply.immediate_response.status.code == 401
    await peer.close()


async def test_chunks_past_the_limit_get_413_before_the_body_ends(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    peer = EnvoyPeer(stub)
    await peer.outbox.put(first())
    piece = b"x" * (MAX_BODY // 2 + 1)
    await peer.outbox.put(ProcessingRequest(request_body=HttpBody(body=piece)))
    reply = await peer.send(ProcessingRequest(request_body=HttpBody(body=piece)))
    assert reply.immediate_response.status.code == 413
    assert orjson.loads(reply.immediate_response.body)["error"]["code"] == "body_too_large"
    await peer.close()


async def test_a_bodyless_get_is_answered_at_once(service) -> None:  # type: ignore[no-untyped-def]
    _, stub = service
    peer = EnvoyPeer(stub)
    reply = await peer.send(first("GET", eos=True))
    assert reply.WhichOneof("response") == "request_headers"
    assert set_headers(reply, "request_headers")["x-tenant-id"] == "globex"
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK


async def test_a_held_request_gets_the_override_then_all_its_replies(service) -> None:  # type: ignore[no-untyped-def]
    gateway, stub = service
    holder = EnvoyPeer(stub)
    await send_all(holder, [first(), *chunks(chat_body(), 1)])
    forwarded = await holder.read()
    assert forwarded.WhichOneof("response") == "request_headers"
    assert (await holder.read()).WhichOneof("response") == "request_body"

    waiting = EnvoyPeer(stub)
    await send_all(waiting, [first(key=TEST_KEYS["initech"]), *chunks(chat_body(), 2)])
    held: ProcessingResponse = await waiting.read()
    assert held.HasField("override_message_timeout")
    assert gateway.scheduler.snapshot()["tenants"]["initech"]["queued"] == 1
    assert await asyncio.wait_for(holder.call.code(), 5) == grpc.StatusCode.OK
    await response_ends(stub, forwarded, phase="request_headers")  # frees the one slot
    replies = [await waiting.read() for _ in range(3)]
    assert [r.WhichOneof("response") for r in replies] == [
        "request_headers",
        "request_body",
        "request_body",
    ]


@pytest.mark.parametrize(
    ("mode", "without_waiting"),
    [
        (BodyMode.NONE, False),
        (BodyMode.STREAMED, False),
        (BodyMode.BUFFERED_PARTIAL, False),
        (BodyMode.FULL_DUPLEX_STREAMED, True),
    ],
    ids=["none", "streamed-waiting", "buffered-partial", "full-duplex"],
)
async def test_a_body_mode_the_service_cannot_admit_by_is_refused(  # type: ignore[no-untyped-def]
    service, mode: int, without_waiting: bool
) -> None:
    """Else the request would go upstream on the headers reply, before any admission, or
    with a body the service saw only part of."""
    gateway, stub = service
    peer = EnvoyPeer(stub)
    reply = await peer.send(first(mode=mode, without_waiting=without_waiting))
    assert reply.immediate_response.status.code == 500
    error = orjson.loads(reply.immediate_response.body)["error"]
    assert error["code"] == "gateway_misconfigured" and "request_body_mode" in error["message"]
    assert gateway.scheduler.snapshot()["tenants"]["globex"]["queued"] == 0
    await peer.close()


@pytest.fixture
async def watched() -> AsyncIterator[tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]]:
    """The service with its overload detector told which streams Envoy waits on."""
    gateway = compose(policy_from_text(policy_yaml()))
    async with served_stub(gateway, tracked=True) as stub:
        yield gateway, stub


def spy_on_waits(gateway: Gateway) -> list[str]:
    """What the servicer tells the overload detector, in order: `opened` (Envoy waits on a
    stream from now) and `answered` (it no longer does)."""
    calls: list[str] = []
    detector = gateway.overload
    opened, answered = detector.stream_opened, detector.stream_answered

    def on_opened(key: object) -> None:
        calls.append("opened")
        opened(key)

    def on_answered(key: object) -> None:
        calls.append("answered")
        answered(key)

    detector.stream_opened = on_opened  # type: ignore[method-assign]
    detector.stream_answered = on_answered  # type: ignore[method-assign]
    return calls


async def until(predicate: Callable[[], bool]) -> bool:
    """Whether `predicate` comes true within 1 s (the server handles what was sent)."""
    for _ in range(200):
        if predicate():
            return True
        await asyncio.sleep(0.005)
    return False


@pytest.mark.parametrize("one_trip", [False, True], ids=["two-trips", "one-trip"])
async def test_a_client_s_slow_upload_is_not_the_service_s_lag(  # type: ignore[no-untyped-def]
    watched, one_trip: bool
) -> None:
    """Between the headers and the body's end Envoy waits on the client, not on us: were
    the stream counted as waited on, a few slow uploads would look like a service falling
    behind, and it would shed."""
    gateway, stub = watched
    calls = spy_on_waits(gateway)
    peer = EnvoyPeer(stub)
    body = chat_body()
    if one_trip:
        await send_all(peer, [first(), *chunks(body, 2)[:1]])
    else:
        await peer.send(headers_message("POST", "/v1/chat/completions", TEST_KEYS["globex"]))
    assert await until(lambda: calls == ["opened", "answered"]), calls
    assert gateway.overload.oldest_pending_age(time.monotonic()) == 0.0
    last = chunks(body, 2)[1] if one_trip else body_message(body)
    await peer.outbox.put(last)
    replies = [await peer.read() for _ in range(3 if one_trip else 1)]
    assert replies[-1].WhichOneof("response") == "request_body"
    assert await asyncio.wait_for(peer.call.code(), 5) == grpc.StatusCode.OK
    # Waited on again from the body's end until the forward, then the stream's end.
    assert calls[2] == "opened" and "answered" in calls[3:]
