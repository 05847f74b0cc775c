"""`extproc serve --envoy-events` with hermetic clients playing Envoy's counting filter (HTTP
calls to the events listener) and its gRPC access log: a request is settled from its
access-log entry with the engine's usage; on SIGTERM the in-flight request still settles and
the process exits as soon as it has, not after the whole drain grace (Envoy's access-log
stream never ends by itself). A drain that begins before Envoy has opened its access-log stream
keeps the gRPC server open for it, and answers new requests 503 meanwhile."""

from __future__ import annotations

import asyncio
import signal
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from envoy.data.accesslog.v3.accesslog_pb2 import HTTPAccessLogEntry
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.accesslog.v3.als_pb2 import StreamAccessLogsMessage
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from extproc.envoy_lua import ACCESS_LOG_NAME, METADATA_NAMESPACE
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import (
    EnvoyPeer,
    body_message,
    chat_body,
    headers_message,
    set_headers,
)
from tests.serve_support import ServeProcess, get_json, serve_process, wait_for

CHAT = "/v1/chat/completions"


class AccessLogPeer:
    """Envoy's gRPC access-log stream: an identifier, then entries as streams end."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.outbox: asyncio.Queue[StreamAccessLogsMessage | None] = asyncio.Queue()
        stub = als_pb2_grpc.AccessLogServiceStub(channel)
        self.call = stub.StreamAccessLogs(self._messages())

    async def _messages(self) -> AsyncIterator[StreamAccessLogsMessage]:
        while (message := await self.outbox.get()) is not None:
            yield message

    async def ended(self, request_id: str, prompt: int, completion: int) -> None:
        entry = HTTPAccessLogEntry()
        entry.response.response_code.value = 200
        entry.common_properties.metadata.filter_metadata[METADATA_NAMESPACE].update(
            {"id": request_id, "tokens": float(completion), "prompt": float(prompt),
             "completion": float(completion), "total": float(prompt + completion)}
        )  # fmt: skip
        message = StreamAccessLogsMessage()
        if self.outbox.empty() and not hasattr(self, "_identified"):
            message.identifier.log_name = ACCESS_LOG_NAME
            self._identified = True
        message.http_logs.log_entry.append(entry)
        await self.outbox.put(message)


def _post(port: int, path: str, body: bytes = b"") -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _events_port(served: ServeProcess) -> int:
    serving = served.find_log("serving")
    assert serving is not None
    return int(serving["envoy_events"])


def _draining(served: ServeProcess) -> tuple[int, Any] | None:
    answer = get_json(served.admin_url + "/readyz")
    return answer if answer[0] == 503 else None


def _inflight(served: ServeProcess) -> int:
    _, view = get_json(served.admin_url + "/v1/tenants")
    return int(view["tenants"]["globex"]["inflight"])


async def _admitted(stub: ext_proc_grpc.ExternalProcessorStub, events_port: int) -> str:
    """A globex request admitted and forwarded, its attach call made, as Envoy's would be."""
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", CHAT, TEST_KEYS["globex"]))
    reply = await peer.send(body_message(chat_body()))
    assert reply.WhichOneof("response") == "request_body", reply
    await peer.close()
    request_id = set_headers(reply, "request_body")["x-gateway-request-id"]
    assert await asyncio.to_thread(_post, events_port, f"/attach/{request_id}") == 204
    return request_id


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml(short_inflight=1))
    return path


async def test_the_access_log_settles_and_a_drain_waits_for_it_only(
    policy_file: Path, tmp_path: Path
) -> None:
    args = ("--envoy-events", "127.0.0.1:0", "--drain-grace", "60")
    with serve_process(policy_file, tmp_path, *args) as served:
        port = _events_port(served)
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            stub = ext_proc_grpc.ExternalProcessorStub(channel)
            access_log = AccessLogPeer(channel)
            first = await _admitted(stub, port)
            assert await asyncio.to_thread(_post, port, f"/first/{first}", b"1") == 204
            assert await asyncio.to_thread(_post, port, f"/output/{first}", b"x") == 400
            await access_log.ended(first, 7, 3)
            # Settled: the pool's one slot is free again, and the next request is admitted.
            second = await _admitted(stub, port)
            assert await asyncio.to_thread(_inflight, served) == 1

            served.signal(signal.SIGTERM)  # handled when the process gets to it: poll
            status, ready = await asyncio.to_thread(
                wait_for, lambda: _draining(served), "/readyz to say draining"
            )
            assert status == 503 and ready["status"] == "draining"
            assert served.process.poll() is None  # the in-flight request holds it
            await access_log.ended(second, 7, 5)
            # Well inside the 60 s grace: nothing in flight, only the log stream left.
            assert await asyncio.to_thread(served.wait, 20) == 0
            access_log.call.cancel()

    drained = served.find_log("drained")
    assert drained is not None and drained["inflight_cut"] == 0
    settled = [e for e in served.log_lines() if e.get("logger") == "extproc.request"]
    assert [(e["outcome"], e["output_tokens"], e["input_tokens"]) for e in settled] == [
        ("admitted", 3, 7),
        ("admitted", 5, 7),
    ], settled


async def test_a_drain_before_the_access_log_opens_waits_for_it_and_answers_new_requests_503(
    policy_file: Path, tmp_path: Path
) -> None:
    args = ("--envoy-events", "127.0.0.1:0", "--drain-grace", "60")
    with serve_process(policy_file, tmp_path, *args) as served:
        port = _events_port(served)
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            stub = ext_proc_grpc.ExternalProcessorStub(channel)
            request_id = await _admitted(stub, port)

            # The first request since Envoy started: no access-log stream is open yet.
            served.signal(signal.SIGTERM)
            await asyncio.to_thread(wait_for, lambda: _draining(served), "/readyz to say draining")
            late = EnvoyPeer(stub)
            await late.send(headers_message("POST", CHAT, TEST_KEYS["acme"]))
            answer = await late.send(body_message(chat_body()))
            assert answer.immediate_response.status.code == 503, answer
            headers = {
                h.header.key: h.header.raw_value.decode()
                for h in answer.immediate_response.headers.set_headers
            }
            assert int(headers["retry-after"]) >= 1
            assert orjson.loads(answer.immediate_response.body)["error"]["type"] == (
                "service_unavailable"
            )
            await late.close()
            assert served.process.poll() is None  # the in-flight request holds it

            access_log = AccessLogPeer(channel)  # opened during the drain, as Envoy would
            await access_log.ended(request_id, 7, 4)
            assert await asyncio.to_thread(served.wait, 20) == 0
            access_log.call.cancel()

    drained = served.find_log("drained")
    assert drained is not None and drained["inflight_cut"] == 0
    assert drained["drained_queued"] == 1  # the late request, answered 503
    settled = {e["tenant"]: e for e in served.log_lines() if e.get("logger") == "extproc.request"}
    assert (settled["globex"]["outcome"], settled["globex"]["output_tokens"]) == ("admitted", 4)
    assert settled["acme"]["status"] == 503
