"""Helpers for the shared-state tests: a private redis-server, `extproc serve` processes, and a
hermetic client that plays Envoy's two ext_proc filters (admission + accounting) over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    ProcessingRequest,
    ProcessingResponse,
)

from extproc.service.processor import http_headers
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_for(check: Callable[[], bool], timeout: float, what: str, step: float = 0.02) -> None:
    """Poll `check` until true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


async def await_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


# -- redis-server ----------------------------------------------------------------------------------


def redis_ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A redis-server on a free loopback port, no persistence, in a temp dir."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="extproc-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = (self.dir / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--protected-mode", "no",
            ],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        wait_for(lambda: redis_ping(self.port), 10, "redis-server to answer")

    def stop(self) -> None:
        terminate(self.process, 5.0)

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.resume()
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        return ""


# -- extproc serve processes -----------------------------------------------------------------------


def http_get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()
    except (OSError, ValueError):
        return 0, b""


def terminate(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class ServeProcess:
    """One `extproc serve` (python -m extproc.service.main) on its own loopback ports."""

    policy: Path
    workdir: Path
    name: str = "extproc"
    grpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "extproc.service.main", "--policy", str(self.policy),
            "--grpc", self.grpc_address, "--admin", f"127.0.0.1:{self.admin_port}",
            "--log-format", "text", "--reload-interval", "0", "--drain-grace", "1",
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        log.close()

    def ready(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log_tail()}")
        return http_get(f"http://127.0.0.1:{self.admin_port}/readyz")[0] == 200

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.admin_port}/metrics")[1].decode()

    def metric(self, name: str, labels: str = "") -> float:
        prefix = f"{name}{{{labels}}} " if labels else f"{name} "
        for line in self.metrics().splitlines():
            if line.startswith(prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def tenants(self) -> dict[str, object]:
        status, body = http_get(f"http://127.0.0.1:{self.admin_port}/v1/tenants")
        assert status == 200, body
        value = orjson.loads(body)
        assert isinstance(value, dict)
        return value

    def stop(self) -> None:
        terminate(self.process, 10.0)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


@contextlib.contextmanager
def serve_processes(
    policy_text: str, workdir: Path, count: int, extra_args: tuple[str, ...] = ()
) -> Iterator[list[ServeProcess]]:
    policy = workdir / "policy.yaml"
    policy.write_text(policy_text)
    processes = [
        ServeProcess(policy, workdir, name=f"extproc-{i}", extra_args=extra_args)
        for i in range(count)
    ]
    try:
        for process in processes:
            process.start()
        for process in processes:
            wait_for(process.ready, 60, f"{process.name} to be ready")
        yield processes
    except BaseException:
        for process in processes:
            print(f"--- log of {process.name} ---\n{process.log_tail()}", file=sys.stderr)
        raise
    finally:
        for process in processes:
            process.stop()


# -- a client playing Envoy ------------------------------------------------------------------------


def chat_body(content: str = "hello", max_tokens: int = 16) -> bytes:
    return orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    )


def _set_headers(response: ProcessingResponse, phase: str) -> dict[str, str]:
    common = getattr(response, phase).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


@dataclass
class Outcome:
    tenant: str
    admitted: bool
    status: int = 200
    request_id: str = ""
    pool: str = ""
    retry_after: str | None = None
    message: str = ""
    sent_at: float = 0.0
    admitted_at: float = 0.0
    finished_at: float = 0.0
    process: int = 0
    call: grpc.aio.StreamStreamCall[ProcessingRequest, ProcessingResponse] | None = None
    accounting: grpc.aio.StreamStreamCall[ProcessingRequest, ProcessingResponse] | None = None


class Endpoint:
    def __init__(self, address: str) -> None:
        # Its own TCP connection: channels to one target otherwise share grpc-core's global
        # subchannel pool (and so one connection, which SO_REUSEPORT gives to one worker).
        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.stub = ext_proc_grpc.ExternalProcessorStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


async def admit(
    endpoint: Endpoint,
    key: str,
    tenant: str,
    body: bytes,
    *,
    timeout: float = 30.0,
    process: int = 0,
) -> Outcome:
    """Request headers + buffered body on an admission stream; wait for the real reply."""
    outcome = Outcome(tenant=tenant, admitted=False, sent_at=time.monotonic(), process=process)
    call = endpoint.stub.Process()
    headers = [
        (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gw"),
        ("authorization", f"Bearer {key}"), ("content-type", "application/json"),
    ]  # fmt: skip
    await call.write(ProcessingRequest(request_headers=http_headers(headers)))
    reply = await asyncio.wait_for(call.read(), timeout)
    if reply.HasField("immediate_response"):
        outcome.status = reply.immediate_response.status.code
        call.cancel()
        return outcome
    await call.write(ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)))
    reply = await asyncio.wait_for(call.read(), timeout)
    if reply.HasField("override_message_timeout"):
        reply = await asyncio.wait_for(call.read(), timeout)
    if reply.HasField("immediate_response"):
        outcome.status = reply.immediate_response.status.code
        outcome.message = reply.immediate_response.body.decode(errors="replace")
        for option in reply.immediate_response.headers.set_headers:
            if option.header.key.lower() == "retry-after":
                outcome.retry_after = option.header.raw_value.decode()
        call.cancel()
        return outcome
    assert reply.HasField("request_body"), reply
    values = _set_headers(reply, "request_body")
    outcome.admitted = True
    outcome.admitted_at = time.monotonic()
    outcome.request_id = values["x-gateway-request-id"]
    outcome.pool = values.get("x-llm-pool", "")
    outcome.call = call
    return outcome


async def attach_accounting(endpoint: Endpoint, outcome: Outcome) -> None:
    """The observability filter's stream sees the request headers (with the request id)."""
    call = endpoint.stub.Process(metadata=((ROLE_METADATA, ACCOUNTING_ROLE),))
    pairs = [(":method", "POST"), (":path", "/v1/chat/completions"),
             ("x-gateway-request-id", outcome.request_id)]  # fmt: skip
    await call.write(
        ProcessingRequest(observability_mode=True, request_headers=http_headers(pairs))
    )
    outcome.accounting = call


async def finish(outcome: Outcome, prompt_tokens: int, completion_tokens: int) -> None:
    """The response: the admission stream has ended (the service ends it right after the
    forward); headers and the body with usage go to the accounting stream, which then ends."""
    outcome.finished_at = time.monotonic()
    response_headers = http_headers([(":status", "200"), ("content-type", "application/json")])
    call = outcome.call
    if call is not None:
        assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
    accounting = outcome.accounting
    if accounting is not None:
        usage = {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}
        await accounting.write(
            ProcessingRequest(observability_mode=True, response_headers=response_headers)
        )
        await accounting.write(
            ProcessingRequest(
                observability_mode=True,
                response_body=HttpBody(body=orjson.dumps(usage), end_of_stream=True),
            )
        )
        await accounting.done_writing()
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.wait_for(accounting.code(), 10)


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most intervals open at once (an end at the same time as a start closes first)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = current = 0
    for _, step in events:
        current += step
        best = max(best, current)
    return best
