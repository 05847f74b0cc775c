"""`extproc serve --workers N`: one port for all workers, crashed workers restarted, and the
memory store refused for N > 1 (it would multiply every limit)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from extproc.service.workers import (
    check_accounting,
    check_envoy_events,
    check_state,
    worker_address,
    worker_addresses,
    worker_commands,
)
from tests.conftest import TEST_KEYS, free_port, policy_yaml
from tests.redis.support import (
    ROOT,
    Endpoint,
    RedisServer,
    admit,
    chat_body,
    finish,
    http_get,
    wait_for,
)
from tests.serve_support import worker_pids


def worker_pid(request_id: str) -> int:
    """Request ids start with the hex pid of the process that admitted the request."""
    return int(request_id.split("-", 1)[0], 16)


def test_worker_addresses() -> None:
    assert worker_address("127.0.0.1:50051", 3, "shared") == "127.0.0.1:50051"
    assert worker_address("127.0.0.1:50051", 3, "distinct") == "127.0.0.1:50054"
    assert worker_address("[::1]:9000", 1, "distinct") == "[::1]:9001"
    assert worker_addresses("127.0.0.1:7000", 3, "distinct") == [
        "127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002",
    ]  # fmt: skip
    assert worker_addresses("127.0.0.1:7000", 3, "shared") == ["127.0.0.1:7000"]


def test_several_workers_need_shared_state(tmp_path: Path) -> None:
    memory = tmp_path / "memory.yaml"
    memory.write_text(policy_yaml())
    problem = check_state(str(memory), 2, allow_unshared=False)
    assert problem is not None and "redis" in problem
    assert check_state(str(memory), 2, allow_unshared=True) is None
    assert check_state(str(memory), 1, allow_unshared=False) is None
    shared = tmp_path / "shared.yaml"
    shared.write_text(policy_yaml(extra="state: {backend: redis, replicas: 2}\n"))
    assert check_state(str(shared), 2, allow_unshared=False) is None
    refused = subprocess.run(
        [sys.executable, "-m", "extproc.service.workers", "--workers", "2",
         "--policy", str(memory), "--grpc", f"127.0.0.1:{free_port()}",
         "--admin", f"127.0.0.1:{free_port()}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "--allow-unshared-workers" in refused.stderr


def test_an_accounting_process_is_refused_with_several_workers(tmp_path: Path) -> None:
    problem = check_accounting(2, "127.0.0.1:7000")
    assert problem is not None and "--accounting-grpc with --workers 2" in problem
    assert check_accounting(1, "127.0.0.1:7000") is None
    assert check_accounting(2, "") is None
    policy = tmp_path / "shared.yaml"
    policy.write_text(policy_yaml(extra="state: {backend: redis, replicas: 2}\n"))
    addresses = [
        "--policy", str(policy), "--grpc", f"127.0.0.1:{free_port()}",
        "--admin", f"127.0.0.1:{free_port()}", "--accounting-grpc", f"127.0.0.1:{free_port()}",
    ]  # fmt: skip
    for command in (
        [sys.executable, "-m", "extproc.service.workers", "--workers", "2", *addresses],
        [sys.executable, "-m", "extproc", "serve", "--workers", "2", *addresses],
        # `extproc up` refuses it before it starts engines or Envoy
        [sys.executable, "-m", "extproc", "up", "--workers", "2", "--policy", str(policy),
         "--accounting-grpc", f"127.0.0.1:{free_port()}"],
    ):  # fmt: skip
        refused = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )
        assert refused.returncode == 2, refused.stderr
        assert "--accounting-grpc with --workers 2 is not supported" in refused.stderr
        assert "supervising" not in refused.stderr  # refused before any worker started
    # The environment variable is the same flag.
    refused = subprocess.run(
        [sys.executable, "-m", "extproc.service.workers", "--workers", "2", *addresses[:6]],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "EXTPROC_ACCOUNTING_GRPC": f"127.0.0.1:{free_port()}"},
    )  # fmt: skip
    assert refused.returncode == 2 and "not supported" in refused.stderr


@contextlib.contextmanager
def running_supervisor(
    redis_server: RedisServer, tmp_path: Path, extra: Sequence[str] = ()
) -> Iterator[tuple[str, list[int], subprocess.Popen[bytes]]]:
    """`python -m extproc.service.workers --workers 2` on Redis state: its gRPC address, the
    workers' admin ports and the supervisor, once both workers are ready; stopped after."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_yaml(extra=f"state: {{backend: redis, url: '{redis_server.url}', replicas: 2}}\n")
    )
    address, admin = f"127.0.0.1:{free_port()}", free_port()
    log_path = tmp_path / "supervisor.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "extproc.service.workers", "--workers", "2",
         "--policy", str(policy), "--grpc", address, "--admin", f"127.0.0.1:{admin}",
         "--log-format", "text", "--reload-interval", "0", "--drain-grace", "1", *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()
    admins = [admin, admin + 1]
    try:
        for port in admins:
            wait_for(
                lambda p=port: http_get(f"http://127.0.0.1:{p}/readyz")[0] == 200, 60, "workers"
            )
        yield address, admins, process
        process.send_signal(signal.SIGTERM)
        code = process.wait(30)
        log_text = log_path.read_text(errors="replace")
        assert code == 0, f"supervisor exited with {code}:\n{log_text[-3000:]}"
    except BaseException:
        print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def supervisor(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[str, list[int]]]:
    with running_supervisor(redis_server, tmp_path) as (address, admins, _):
        yield address, admins


@pytest.mark.redis
async def test_workers_share_one_port_and_a_dead_worker_comes_back(
    supervisor: tuple[str, list[int]],
) -> None:
    address, _admins = supervisor

    async def pids_seen(connections: int, tolerate_resets: bool = False) -> set[int]:
        pids = set()
        for _ in range(connections):
            endpoint = Endpoint(address)  # a new connection each: the kernel picks a worker
            try:
                try:
                    outcome = await admit(endpoint, TEST_KEYS["globex"], "globex", chat_body())
                except grpc.aio.AioRpcError as error:
                    # a connection queued on the worker that just died is reset; Envoy retries
                    if tolerate_resets and error.code() == grpc.StatusCode.UNAVAILABLE:
                        continue
                    raise
                assert outcome.admitted, outcome
                pids.add(worker_pid(outcome.request_id))
                await finish(outcome, 3, 16)
            finally:
                await endpoint.close()
        return pids

    first = await pids_seen(24)
    assert len(first) == 2, first  # both workers serve (SO_REUSEPORT spreads connections)
    victim = min(first)
    os.kill(victim, signal.SIGKILL)  # a crash: the supervisor must start a new worker
    deadline = time.monotonic() + 30
    seen: set[int] = set()
    while not seen - first:  # the survivor serves meanwhile; then the new one joins
        assert time.monotonic() < deadline, f"no new worker after the crash: {seen}"
        seen |= await pids_seen(4, tolerate_resets=True)
    assert victim not in seen


def test_envoy_events_with_several_workers_need_ports_of_their_own(tmp_path: Path) -> None:
    problem = check_envoy_events(2, "127.0.0.1:7000", "shared")
    assert problem is not None and "needs --worker-ports distinct" in problem
    problem = check_envoy_events(2, "127.0.0.1:0", "distinct")
    assert problem is not None and "give a port" in problem
    assert check_envoy_events(2, "127.0.0.1:7000", "distinct") is None
    assert check_envoy_events(1, "127.0.0.1:7000", "shared") is None
    assert check_envoy_events(2, "", "shared") is None
    policy = tmp_path / "shared.yaml"
    policy.write_text(policy_yaml(extra="state: {backend: redis, replicas: 2}\n"))
    events = f"127.0.0.1:{free_port()}"
    for command in (
        [sys.executable, "-m", "extproc", "serve", "--workers", "2", "--policy", str(policy),
         "--grpc", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{free_port()}",
         "--envoy-events", events],
        [sys.executable, "-m", "extproc", "up", "--workers", "2", "--policy", str(policy),
         "--worker-ports", "shared", "--count-in-envoy", events],
    ):  # fmt: skip
        refused = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )
        assert refused.returncode == 2, refused.stderr
        assert "--envoy-events with --workers 2 needs --worker-ports distinct" in refused.stderr


def test_each_worker_gets_its_own_events_port() -> None:
    args = argparse.Namespace(
        policy="p.yaml", admin="127.0.0.1:9090", workers=3, worker_ports="distinct",
        envoy_events="127.0.0.1:7100",
    )  # fmt: skip
    commands = worker_commands(args, "127.0.0.1:7000")
    events = [command[command.index("--envoy-events") + 1] for command in commands]
    grpcs = [command[command.index("--grpc") + 1] for command in commands]
    assert events == ["127.0.0.1:7100", "127.0.0.1:7101", "127.0.0.1:7102"]
    assert grpcs == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
    args.envoy_events = ""
    assert all("--envoy-events" not in command for command in worker_commands(args, "a:1"))


@pytest.mark.redis
def test_a_hung_worker_is_killed_and_restarted(redis_server: RedisServer, tmp_path: Path) -> None:
    """A stopped worker does not exit, and holds its ports while every stream Envoy sends it
    times out: once its /healthz has been silent for --worker-liveness-timeout, the
    supervisor kills it and starts a new one in its place."""
    extra = ["--worker-liveness-timeout", "1.5"]
    with running_supervisor(redis_server, tmp_path, extra) as (_, admins, process):
        before = worker_pids(process.pid, "--admin")
        victim = before[admins[1]]
        log_path = tmp_path / "supervisor.log"
        watched = f"127.0.0.1:{admins[1]}/healthz answers: watched"
        # A worker gets a start-up grace until its first answer: stop it once it is watched.
        wait_for(lambda: watched in log_path.read_text(errors="replace"), 30, "the watch")
        os.kill(victim, signal.SIGSTOP)
        try:
            wait_for(
                lambda: worker_pids(process.pid, "--admin").get(admins[1], victim) != victim,
                30, "the hung worker replaced",
            )  # fmt: skip
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
        wait_for(
            lambda: http_get(f"http://127.0.0.1:{admins[1]}/readyz")[0] == 200, 60, "the new one"
        )
        assert not Path(f"/proc/{victim}").exists(), "the hung worker was not killed"
        # The other worker was left alone.
        assert worker_pids(process.pid, "--admin")[admins[0]] == before[admins[0]]
    log_text = (tmp_path / "supervisor.log").read_text(errors="replace")
    assert f"worker 1 (pid {victim}) has not answered" in log_text, log_text[-2000:]
