"""Helpers of the production tests: a `serve` subprocess, HTTP calls, polling with deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA
from tests.grpc.test_extproc_stream import EnvoyPeer

REPO = Path(__file__).resolve().parents[1]

T = TypeVar("T")


def wait_for(
    check: Callable[[], T | None], what: str, timeout: float = 10.0, every: float = 0.02
) -> T:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


def worker_pids(supervisor_pid: int, flag: str = "--grpc") -> dict[int, int]:
    """The pids of a supervisor's children (the workers of `serve --workers N`, the service
    of `extproc up`), by the port each was given with `flag` (their command lines tell them
    apart)."""
    pids: dict[int, int] = {}
    children = Path(f"/proc/{supervisor_pid}/task/{supervisor_pid}/children").read_text()
    for pid in map(int, children.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:  # exited between the two reads
            continue
        if flag.encode() in argv:
            pids[int(argv[argv.index(flag.encode()) + 1].rpartition(b":")[2])] = pid
    return pids


class AccountingPeer(EnvoyPeer):
    """The accounting filter's stream: observability mode, its role in the initial metadata
    (as extproc/envoy_config.py renders it). Envoy never waits for replies: use `outbox`."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub) -> None:
        self.outbox: asyncio.Queue[ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._requests(), metadata=((ROLE_METADATA, ACCOUNTING_ROLE),))


def http(
    method: str, url: str, body: bytes | None = None, timeout: float = 5.0
) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def get_json(url: str) -> tuple[int, Any]:
    status, _, body = http("GET", url)
    return status, json.loads(body)


@dataclass
class ServeProcess:
    """`extproc serve` (python -m extproc.service.main) on ephemeral loopback ports."""

    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_port: int = 0
    admin_port: int = 0
    lines: list[dict[str, Any]] = field(default_factory=list)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_lines(self) -> list[dict[str, Any]]:
        """Every line of the service's stderr, parsed as JSON (fails on a non-JSON line)."""
        out = []
        for line in self.log_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise AssertionError(f"not a JSON log line: {line!r}") from error
        return out

    def find_log(self, message: str) -> dict[str, Any] | None:
        return next((e for e in self.log_lines() if e.get("message") == message), None)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout)


@contextlib.contextmanager
def serve_process(
    policy: Path,
    workdir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    ready_timeout: float = 30.0,
) -> Iterator[ServeProcess]:
    log_path = workdir / "serve.log"
    command = [
        sys.executable, "-m", "extproc.service.main", "--policy", str(policy),
        "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--log-format", "json", *args,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
    served = ServeProcess(process, log_path)
    try:

        def started() -> dict[str, Any] | None:
            if process.poll() is not None:
                raise AssertionError(f"serve exited early:\n{served.log_text()}")
            for line in served.log_text().splitlines():
                if '"serving"' in line:
                    entry: dict[str, Any] = json.loads(line)
                    return entry
            return None

        entry = wait_for(started, "the service to start", ready_timeout, every=0.05)
        served.grpc_port = int(str(entry["grpc"]).rpartition(":")[2])
        served.admin_port = int(str(entry["admin"]).rpartition(":")[2])
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(10)
