"""Graceful drain of `extproc serve` on SIGTERM, with a hermetic gRPC client playing Envoy.

One request is in flight (admitted, its response streaming through the accounting stream) and
one is queued behind it. On SIGTERM: /readyz turns 503, the queued request is answered 503 with
Retry-After, new streams are refused, the in-flight response completes, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
)

from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import (
    EnvoyPeer,
    body_message,
    chat_body,
    headers_message,
    set_headers,
)
from tests.serve_support import AccountingPeer, ServeProcess, get_json, serve_process, wait_for

CHAT = "/v1/chat/completions"


def _headers(pairs: dict[str, str], eos: bool = False) -> HttpHeaders:
    return HttpHeaders(
        headers=HeaderMap(
            headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=eos,
    )


class InFlight:
    """An admitted request still running upstream: its admission stream waits for the
    response headers and its accounting stream (observability mode) is open, as in Envoy
    between admission and the end of the response."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub) -> None:
        self.stub = stub
        self.admission = EnvoyPeer(stub)
        self.accounting = AccountingPeer(stub)

    async def start(self, key: str) -> str:
        await self.admission.send(headers_message("POST", CHAT, key))
        reply = await self.admission.send(body_message(chat_body()))
        assert reply.WhichOneof("response") == "request_body", reply
        request_id = set_headers(reply, "request_body")["x-gateway-request-id"]
        await self.accounting.outbox.put(
            ProcessingRequest(observability_mode=True, request_headers=_headers(
                {":method": "POST", ":path": CHAT, "x-gateway-request-id": request_id}
            ))
        )  # fmt: skip
        return request_id

    async def finish(self) -> None:
        """The response arrives and ends: the accounting stream settles it, then Envoy closes
        the admission stream after passing it the response headers."""
        response_headers = _headers({":status": "200", "content-type": "application/json"})
        body = orjson.dumps(
            {"id": "x", "choices": [{"message": {"content": "ok"}}],
             "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
        )  # fmt: skip
        put = self.accounting.outbox.put
        await put(ProcessingRequest(observability_mode=True, response_headers=response_headers))
        await put(
            ProcessingRequest(
                observability_mode=True, response_body=HttpBody(body=body, end_of_stream=True)
            )
        )
        await self.accounting.close()
        assert await asyncio.wait_for(self.accounting.call.code(), 10) == grpc.StatusCode.OK
        await self.admission.send(ProcessingRequest(response_headers=response_headers))
        await self.admission.close()
        assert await asyncio.wait_for(self.admission.call.code(), 10) == grpc.StatusCode.OK

    def cancel(self) -> None:
        self.admission.call.cancel()
        self.accounting.call.cancel()


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml(short_inflight=1))
    return path


@pytest.fixture
async def channel_factory() -> AsyncIterator[list[grpc.aio.Channel]]:
    channels: list[grpc.aio.Channel] = []
    try:
        yield channels
    finally:
        for channel in channels:
            await channel.close()


def _stub(
    served: ServeProcess, channels: list[grpc.aio.Channel]
) -> ext_proc_grpc.ExternalProcessorStub:
    channel = grpc.aio.insecure_channel(served.grpc_target)
    channels.append(channel)
    return ext_proc_grpc.ExternalProcessorStub(channel)


def _queued(served: ServeProcess, tenant: str) -> bool:
    _, view = get_json(served.admin_url + "/v1/tenants")
    return bool(view["tenants"][tenant]["queued"] == 1)


async def test_sigterm_answers_queued_503_lets_inflight_finish_and_exits_0(
    policy_file: Path, tmp_path: Path, channel_factory: list[grpc.aio.Channel]
) -> None:
    with serve_process(policy_file, tmp_path, "--drain-grace", "30") as served:
        stub = _stub(served, channel_factory)
        inflight = InFlight(stub)
        await inflight.start(TEST_KEYS["globex"])

        queued = EnvoyPeer(stub)
        await queued.send(headers_message("POST", CHAT, TEST_KEYS["initech"]))
        held = await queued.send(body_message(chat_body()))
        assert held.HasField("override_message_timeout")
        await asyncio.to_thread(wait_for, lambda: _queued(served, "initech"), "a queued request")
        status, ready = get_json(served.admin_url + "/readyz")
        assert status == 200 and ready["status"] == "ready"

        served.signal(signal.SIGTERM)

        answer = await queued.read()
        assert answer.WhichOneof("response") == "immediate_response"
        assert answer.immediate_response.status.code == 503
        headers = {
            h.header.key: h.header.raw_value.decode()
            for h in answer.immediate_response.headers.set_headers
        }
        assert int(headers["retry-after"]) >= 1
        error = orjson.loads(answer.immediate_response.body)["error"]
        assert error["type"] == "service_unavailable"
        await queued.close()  # Envoy ends the stream after an immediate response

        # Still draining: the in-flight response holds the process, readiness says so.
        status, ready = get_json(served.admin_url + "/readyz")
        assert status == 503 and ready["status"] == "draining"
        assert served.process.poll() is None

        # New streams are refused while draining.
        refused = EnvoyPeer(stub)
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await refused.send(headers_message("POST", CHAT, TEST_KEYS["acme"]))
        assert refusal.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}

        await inflight.finish()
        assert await asyncio.to_thread(served.wait, 20) == 0

    lines = served.log_lines()  # every line is JSON
    drained = next(e for e in lines if e.get("message") == "drained")
    assert drained["drained_queued"] == 1 and drained["inflight_cut"] == 0
    requests = [e for e in lines if e.get("logger") == "extproc.request"]
    finished = next(e for e in requests if e["tenant"] == "globex")
    assert finished["outcome"] == "admitted" and finished["output_tokens"] == 3
    rejected = next(e for e in requests if e["tenant"] == "initech")
    assert rejected["status"] == 503


async def test_drain_grace_cuts_unfinished_responses_and_still_exits_0(
    policy_file: Path, tmp_path: Path, channel_factory: list[grpc.aio.Channel]
) -> None:
    with serve_process(policy_file, tmp_path, "--drain-grace", "0.5") as served:
        stub = _stub(served, channel_factory)
        inflight = InFlight(stub)
        await inflight.start(TEST_KEYS["globex"])
        served.signal(signal.SIGTERM)
        assert await asyncio.to_thread(served.wait, 20) == 0
        inflight.cancel()
    drained = served.find_log("drain grace over; in-flight requests were cut")
    assert drained is not None and drained["inflight_cut"] == 1


async def test_second_signal_cuts_the_drain_short(
    policy_file: Path, tmp_path: Path, channel_factory: list[grpc.aio.Channel]
) -> None:
    with serve_process(policy_file, tmp_path, "--drain-grace", "60") as served:
        stub = _stub(served, channel_factory)
        inflight = InFlight(stub)
        await inflight.start(TEST_KEYS["globex"])
        served.signal(signal.SIGTERM)
        await asyncio.to_thread(wait_for, lambda: served.find_log("draining"), "the drain to begin")
        served.signal(signal.SIGINT)
        assert await asyncio.to_thread(served.wait, 20) == 0
        inflight.cancel()
    assert served.find_log("second stop signal: cutting the drain short") is not None


def test_invalid_policy_at_start_exits_1_with_file_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.serve_support import REPO

    bad = tmp_path / "bad.yaml"
    bad.write_text(policy_yaml().replace("tier: premium", "tier: gold"))
    result = subprocess.run(
        [sys.executable, "-m", "extproc.service.main", "--policy", str(bad),
         "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 1
    entries = [orjson.loads(line) for line in result.stderr.splitlines() if line.strip()]
    error = next(e for e in entries if e["level"] == "error")
    assert any(f"{bad}:" in issue and "unknown tier" in issue for issue in error["errors"])


def test_a_taken_grpc_port_at_start_exits_1_saying_the_address_is_in_use(tmp_path: Path) -> None:
    """Not a hang: the engine poller's stop used to swallow its cancel here (a start that
    fails stops the engine watcher, then the poller, in one turn)."""
    import errno
    import socket
    import subprocess
    import sys

    from tests.serve_support import REPO

    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "extproc.service.main", "--policy", str(policy),
             "--grpc", f"127.0.0.1:{port}", "--admin", "127.0.0.1:0"],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
    assert result.returncode == 1
    entries = [orjson.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    error = next(e for e in entries if e["level"] == "error")
    assert error["message"] == (
        f"cannot start: [Errno {errno.EADDRINUSE}] cannot bind the gRPC server to "
        f"127.0.0.1:{port}: address already in use"
    )
