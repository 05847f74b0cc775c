"""Hermetic: the accounting streams served by a child process (`serve --accounting-grpc`).

The admission streams go to this process's gRPC server, the accounting streams to the child's;
what the child sees reaches the scheduler here as events: the first token (prefill pacing), the
streamed output, the end with its usage. A child that dies leaves no capacity taken, and is
restarted on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from extproc.policy import policy_from_text
from extproc.service import request as request_record
from extproc.service.accounting_link import IDLE_LAG_INTERVAL_S
from extproc.service.accounting_process import AccountingChild
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from tests.conftest import policy_yaml
from tests.grpc.test_engine_priority import _AccountingStream, _chat, _forward, _policy
from tests.grpc.test_extproc_stream import response_ends, set_headers
from tests.grpc_support import served_stub
from tests.serve_support import ServeProcess, get_json, http, serve_process, wait_for

Stub = ext_proc_grpc.ExternalProcessorStub


async def until(check, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Poll the (asynchronously fed) scheduler state; fail after `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def counted(gateway: Gateway, tenant: str, direction: str) -> float | None:
    return gateway.metrics.registry.get_sample_value(
        "extproc_tokens_total", {"tenant": tenant, "direction": direction}
    )


@contextlib.asynccontextmanager
async def child_served(gateway: Gateway) -> AsyncIterator[tuple[AccountingChild, Stub]]:
    child = AccountingChild(gateway, "127.0.0.1:0")
    port = await child.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield child, ext_proc_grpc.ExternalProcessorStub(channel)
    finally:
        await channel.close()
        await child.stop()


@pytest.fixture
async def served() -> AsyncIterator[tuple[Gateway, Stub, AccountingChild, Stub]]:
    gateway = compose(policy_from_text(policy_yaml(short_inflight=1)))
    async with served_stub(gateway) as admission, child_served(gateway) as (child, accounting):
        yield gateway, admission, child, accounting


async def test_a_response_accounted_by_the_child_settles_here(served) -> None:  # type: ignore[no-untyped-def]
    gateway, admission, child, accounting = served
    first, forward = await _forward(admission, "globex", _chat())
    assert forward.WhichOneof("response") == "request_body"
    second, held = await _forward(admission, "initech", _chat())
    assert held.HasField("override_message_timeout")  # short_inflight=1: the first holds it
    await response_ends(accounting, forward, usage=(9, 4))
    reply = await second.read()  # the child's settle freed the slot here
    assert reply.WhichOneof("response") == "request_body"
    assert counted(gateway, "globex", "input") == 9
    assert counted(gateway, "globex", "output") == 4
    assert child.open_streams == 0
    for peer in (first, second):
        await peer.close()
        await peer.call.code()


async def test_the_first_token_seen_by_the_child_paces_the_next_request() -> None:
    gateway = compose(policy_from_text(_policy("prefill_budget_tokens: 5")))
    async with served_stub(gateway) as admission, child_served(gateway) as (_child, accounting):
        first, forward = await _forward(admission, "globex", _chat(stream=True))
        request_id = set_headers(forward, "request_body")["x-gateway-request-id"]
        second, held = await _forward(admission, "globex", _chat(stream=True))
        assert held.HasField("override_message_timeout")  # paced: the first prefills
        stream = _AccountingStream(accounting, request_id)
        stream.chunk(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
        reply = await second.read()
        assert reply.WhichOneof("response") == "request_body"
        assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 2
        stream.chunk(b'data: {"choices": [], "usage": {"prompt_tokens": 3, ')
        stream.chunk(b'"completion_tokens": 7, "total_tokens": 10}}\n\ndata: [DONE]\n\n')
        await stream.end()
        await until(
            lambda: gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 1, "settle"
        )
        assert counted(gateway, "globex", "output") == 7
        for peer in (first, second):
            await peer.close()
            await peer.call.code()


async def test_a_dead_child_leaves_no_capacity_taken_and_is_restarted(served) -> None:  # type: ignore[no-untyped-def]
    gateway, admission, child, accounting = served
    first, forward = await _forward(admission, "globex", _chat(stream=True))
    request_id = set_headers(forward, "request_body")["x-gateway-request-id"]
    stream = _AccountingStream(accounting, request_id)
    stream.chunk(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
    await until(lambda: child.open_streams == 1, "the child's attach")
    pid = child.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # Settled with the output the child reported: the slot is free at once.
    await until(lambda: gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0, "settle")
    await until(lambda: child.restarts == 1 and child.pid != pid, "the restart")
    assert (await stream.call.code()) != grpc.StatusCode.OK  # the stream died with the child
    # The restarted child serves the same port and accounts the next request.
    second, forward = await _forward(admission, "initech", _chat())
    assert forward.WhichOneof("response") == "request_body"
    await response_ends(accounting, forward, usage=(5, 2))
    await until(lambda: gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0, "settle")
    assert counted(gateway, "initech", "output") == 2
    for peer in (first, second):
        await peer.close()
        await peer.call.code()


async def test_admission_is_answered_while_the_child_is_frozen(served) -> None:  # type: ignore[no-untyped-def]
    """The child's stalls are not the admission's: frozen, it delays only the accounting."""
    gateway, admission, child, accounting = served
    pid = child.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        first, forward = await _forward(admission, "globex", _chat())
        assert forward.WhichOneof("response") == "request_body"
        assert await asyncio.wait_for(first.call.code(), 5) == grpc.StatusCode.OK
    finally:
        os.kill(pid, signal.SIGCONT)
    await response_ends(accounting, forward, usage=(1, 1))
    await until(lambda: gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0, "settle")


async def _forward_while_frozen_holds_the_slot(
    gateway: Gateway,
    admission: Stub,
    child: AccountingChild,
    accounting: Stub,
    frozen: Callable[[], Awaitable[None]],
    held_s: float,
) -> None:
    """Freeze the child, wait for `frozen`, forward a request: its slot stays taken for
    `held_s` while the child cannot attach; thawed, it attaches and settles."""
    gateway.accounting_runs_behind_by(child.behind_s)
    pid = child.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        await frozen()
        first, forward = await _forward(admission, "globex", _chat())
        assert await asyncio.wait_for(first.call.code(), 5) == grpc.StatusCode.OK
        ends = asyncio.ensure_future(response_ends(accounting, forward, usage=(2, 3)))
        await asyncio.sleep(held_s)  # the span the slot must stay taken, not a wait for it
        assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 1
    finally:
        os.kill(pid, signal.SIGCONT)
    await ends
    await until(lambda: counted(gateway, "globex", "output") == 3, "the settle")
    assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0
    await first.close()


async def test_capacity_waits_for_an_accounting_process_that_is_behind(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A frozen child reports nothing: its silence counts as lag, so a forwarded request's
    slot is not freed after the attach grace as if its accounting stream would never come
    (that would admit work the engine still runs); it attaches and settles once thawed."""
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 0.05)
    gateway = compose(policy_from_text(policy_yaml(short_inflight=1)))
    async with served_stub(gateway) as admission, child_served(gateway) as (child, accounting):
        await until(lambda: child.behind_s() == 0.0 and child.applier is not None, "a report")

        async def silence_counts() -> None:
            await until(lambda: child.behind_s() > 0.1, "the silence to count")

        await _forward_while_frozen_holds_the_slot(
            gateway,
            admission,
            child,
            accounting,
            silence_counts,
            held_s=0.5,  # ten graces
        )


async def test_an_idle_child_frozen_before_a_forward_still_holds_its_capacity(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With no stream open the child reports only every IDLE_LAG_INTERVAL_S; frozen then, a
    forward right after is not attached within the grace, and the silence since the forward
    (not since the idle report) says it is behind: the slot stays taken until it attaches."""
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 0.3)
    gateway = compose(policy_from_text(policy_yaml(short_inflight=1)))
    async with served_stub(gateway) as admission, child_served(gateway) as (child, accounting):
        await until(
            lambda: (
                child.applier is not None and child.applier.report_interval_s == IDLE_LAG_INTERVAL_S
            ),
            "an idle report",
        )

        async def at_once() -> None:
            return None

        await _forward_while_frozen_holds_the_slot(
            gateway,
            admission,
            child,
            accounting,
            at_once,
            held_s=1.0,  # 2 idle intervals
        )


async def test_without_reports_the_attach_grace_frees_the_slot(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The same request when the accounting side is not behind (a child that is down, or
    in-process accounting): freed after the grace, as before."""
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 0.05)
    gateway = compose(policy_from_text(policy_yaml(short_inflight=1)))
    gateway.accounting_runs_behind_by(lambda forwarded_at: 0.0)
    async with served_stub(gateway) as admission:
        first, _ = await _forward(admission, "globex", _chat())
        assert await asyncio.wait_for(first.call.code(), 5) == grpc.StatusCode.OK
        await until(
            lambda: gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 0, "the grace"
        )
        await first.close()


async def test_the_drain_waits_for_the_responses_the_child_accounts(tmp_path: Path) -> None:
    """`serve --accounting-grpc`: on SIGTERM the admission server stops at once, but the
    process stays (draining) until the response the child is accounting has ended and settled;
    then it stops the child and exits 0."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml(short_inflight=1))
    args = ("--drain-grace", "30", "--accounting-grpc", "127.0.0.1:0")
    with serve_process(policy, tmp_path, *args) as served:
        serving = served.find_log("serving")
        assert serving is not None
        admission_channel = grpc.aio.insecure_channel(served.grpc_target)
        child_channel = grpc.aio.insecure_channel(f"127.0.0.1:{serving['accounting_grpc']}")
        try:
            admission = ext_proc_grpc.ExternalProcessorStub(admission_channel)
            first, forward = await _forward(admission, "globex", _chat(stream=True))
            request_id = set_headers(forward, "request_body")["x-gateway-request-id"]
            stream = _AccountingStream(
                ext_proc_grpc.ExternalProcessorStub(child_channel), request_id
            )
            stream.chunk(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
            await asyncio.to_thread(
                wait_for, lambda: _inflight(served) == 1 and _first_token_seen(served), "the attach"
            )
            served.signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_for, lambda: get_json(served.admin_url + "/readyz")[0] == 503, "draining"
            )
            await asyncio.sleep(0.5)
            assert served.process.poll() is None  # held by the child's open stream
            stream.chunk(b'data: {"choices": [], "usage": {"prompt_tokens": 3, ')
            stream.chunk(b'"completion_tokens": 7, "total_tokens": 10}}\n\ndata: [DONE]\n\n')
            await stream.end()
            assert await asyncio.to_thread(served.wait, 20) == 0
            await first.close()
        finally:
            await admission_channel.close()
            await child_channel.close()
    drained = served.find_log("drained")
    assert drained is not None and drained["inflight_cut"] == 0
    (finished,) = [e for e in served.log_lines() if e.get("logger") == "extproc.request"]
    assert finished["outcome"] == "admitted" and finished["output_tokens"] == 7


def _inflight(served: ServeProcess) -> int:
    _, view = get_json(served.admin_url + "/v1/tenants")
    return int(view["pools"]["short"]["inflight"])


def _first_token_seen(served: ServeProcess) -> bool:
    """The child's attach and first byte reached the parent: its TTFT histogram counted one."""
    _, _, body = http("GET", served.admin_url + "/metrics")
    return any(
        line.startswith("extproc_ttft_seconds_count") and not line.endswith(" 0.0")
        for line in body.decode().splitlines()
    )


async def test_with_two_accounting_sides_the_one_further_behind_holds_the_slot(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A service taking the accounting filter's streams and Envoy's counting calls at once (while
    Envoys move from one layout to the other): a side that is not behind, registered last,
    does not hide one that is."""
    monkeypatch.setattr(request_record, "ATTACH_GRACE_S", 0.05)
    gateway = compose(policy_from_text(policy_yaml(short_inflight=1)))
    gateway.accounting_runs_behind_by(lambda forwarded_at: 30.0)
    gateway.accounting_runs_behind_by(lambda forwarded_at: 0.0)
    async with served_stub(gateway) as admission:
        first, _ = await _forward(admission, "globex", _chat())
        assert await asyncio.wait_for(first.call.code(), 5) == grpc.StatusCode.OK
        await asyncio.sleep(0.5)  # ten graces: the span the slot must stay taken, not a wait
        assert gateway.scheduler.snapshot()["pools"]["short"]["inflight"] == 1
        await first.close()
