"""`python -m gateway_lab.bench.noop --sync`, the floor on grpc's synchronous server (the
`noop-sync` arm of the low-load benchmark), answers each phase Envoy waits on, skips the
observability stream's messages as the asyncio floor does, and stops on SIGTERM."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
from collections.abc import Iterator

import grpc
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from tests.conftest import free_port

HEADERS = ProcessingRequest(
    request_headers=HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/v1/completions")])
    )
)
OBSERVED = ProcessingRequest(observability_mode=True, response_body=HttpBody(body=b"data: x"))
BODY = ProcessingRequest(
    request_body=HttpBody(body=b'{"prompt": "hi", "stream": true}', end_of_stream=True)
)
NOOP = [sys.executable, "-m", "gateway_lab.bench.noop", "--sync"]


def test_answers_each_phase_and_stops_on_sigterm() -> None:
    port = free_port()
    server = subprocess.Popen([*NOOP, "--grpc", f"127.0.0.1:{port}"], stdout=subprocess.PIPE)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            outbox: queue.Queue[ProcessingRequest | None] = queue.Queue()

            def requests() -> Iterator[ProcessingRequest]:
                while (request := outbox.get(timeout=10)) is not None:
                    yield request

            replies: Iterator[ProcessingResponse] = ext_proc_grpc.ExternalProcessorStub(
                channel
            ).Process(requests(), timeout=30)
            outbox.put(OBSERVED)  # never answered: the next reply is the headers'
            outbox.put(HEADERS)
            assert next(replies).WhichOneof("response") == "request_headers"
            outbox.put(BODY)
            assert next(replies).WhichOneof("response") == "request_body"
            outbox.put(None)
            assert list(replies) == []  # the client's end ends the stream, nothing after
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
        assert server.stdout is not None
        assert b"synchronous grpc" in server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)


def test_sync_serves_the_floor_only() -> None:
    """`--sync` with `--mimic` is refused with the usage exit code, before any port is bound."""
    done = subprocess.run([*NOOP, "--mimic", "short"], capture_output=True, timeout=60, check=False)
    assert done.returncode == 2
    assert b"--sync serves the do-nothing servicer only" in done.stderr
