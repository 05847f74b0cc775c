"""`extproc serve --accounting-grpc ADDRESS`: the accounting streams in a child process.

The child serves only the accounting filter (its own Envoy cluster, extproc.envoy_config) and
sends the admitting process compact events (extproc.service.accounting_link). Under a CPU the
host saturates, the admission process then waits on no chunk: the kernel schedules it as soon
as Envoy writes, and the messages Envoy waits on are answered in time.

Lifecycle: the parent starts the child and waits for its "ready" (the port it serves);
a child that dies is restarted (with backoff) and the requests it was accounting are settled
with the output it had reported (the engines' counters correct the rest, extproc.service.
reconcile). The child exits when its link to the parent closes (the parent stopped, or died:
it also gets SIGKILL then, on Linux), and ignores SIGINT/SIGTERM, which a terminal or a process
manager may send the whole group: the parent decides when accounting ends, after its drain.

    python -m extproc.service.accounting_process --grpc ADDRESS --fd N
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence

from extproc.heap import freeze_startup_heap
from extproc.service.accounting_link import (
    READY,
    ApplierProtocol,
    EventApplier,
    ForwardingPort,
    LagReporter,
    encode_frame,
)
from extproc.service.logs import configure_logging
from extproc.service.ports import AccountingPort

log = logging.getLogger("extproc.accounting_process")

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
RESTART_BACKOFF_MIN_S, RESTART_BACKOFF_MAX_S = 0.2, 10.0
_PR_SET_PDEATHSIG = 1
NICENESS = 10
"""The child runs at a lower CPU priority than its parent: when the host is saturated, the
kernel gives the admission process (whose replies Envoy waits on) the CPU first, and the
accounting falls behind instead; the parent then holds the capacity of the requests it has not
heard of yet (`Settlement.accounting_behind`), which slows admission to what is accounted."""


class AccountingChild:
    """The parent's handle on its accounting process: start, restart on death, stop."""

    def __init__(
        self,
        port: AccountingPort,
        address: str,
        log_format: str = "json",
        forwarded_at: Callable[[str], float | None] = lambda request_id: None,
    ) -> None:
        self._port = port
        self._forwarded_at = forwarded_at
        self.address = address
        self._log_format = log_format
        self.grpc_port = 0
        self.applier: EventApplier | None = None
        self.restarts = 0
        self._process: asyncio.subprocess.Process | None = None
        self._transport: asyncio.Transport | None = None
        self._stopping = False
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def open_streams(self) -> int:
        return self.applier.open_streams if self.applier is not None else 0

    def behind_s(self, forwarded_at: float | None = None) -> float:
        """How far behind the running child is (0 while none runs): attaches may come late
        (`forwarded_at`: see `EventApplier.behind_s`)."""
        return self.applier.behind_s(forwarded_at) if self.applier is not None else 0.0

    async def start(self) -> int:
        """Start the child; its gRPC port once it serves (OSError if it does not)."""
        await self._spawn()
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        return self.grpc_port

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        applier = EventApplier(self._port, forwarded_at=self._forwarded_at)
        try:
            # A restarted child binds the port its first run got (the address may say 0).
            host = self.address.rpartition(":")[0]
            address = f"{host}:{self.grpc_port}" if self.grpc_port else self.address
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "extproc.service.accounting_process",
                "--grpc", address, "--fd", str(theirs.fileno()),
                "--log-format", self._log_format,
                pass_fds=(theirs.fileno(),),
            )  # fmt: skip
        finally:
            theirs.close()
        transport, _ = await loop.create_connection(
            lambda: ApplierProtocol(applier, lambda: self._link_lost(applier)), sock=ours
        )
        self._transport = transport  # type: ignore[assignment]
        self.applier = applier
        try:
            self.grpc_port = await asyncio.wait_for(asyncio.shield(applier.ready), READY_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError):
            await self._kill()
            raise OSError(f"the accounting process did not serve {address}") from None
        log.info("accounting process %s serves %s", self.pid, f"{host}:{self.grpc_port}")

    def _link_lost(self, applier: EventApplier) -> None:
        if not applier.ready.done():
            applier.ready.cancel()
        settled = applier.link_lost()
        if settled:
            log.warning("accounting link lost: %d requests settled with what was seen", settled)

    async def _supervise(self) -> None:
        backoff = RESTART_BACKOFF_MIN_S
        while not self._stopping:
            process = self._process
            if process is None:
                return
            code = await process.wait()
            if self._stopping:
                return
            log.error("accounting process %s exited (%s); restarting", process.pid, code)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
            try:
                await self._spawn()
                self.restarts += 1
            except OSError as error:
                log.error("%s", error)

    async def _kill(self) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    async def stop(self) -> None:
        """Close the link (the child stops serving and exits), then reap it."""
        self._stopping = True
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        if self._transport is not None:
            self._transport.close()
        process = self._process
        if process is not None and process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                await self._kill()


# -- the child -----------------------------------------------------------------------------------


class _LinkProtocol(asyncio.Protocol):
    def __init__(self, closed: asyncio.Event) -> None:
        self._closed = closed

    def data_received(self, data: bytes) -> None:
        del data  # the parent sends nothing

    def connection_lost(self, exc: Exception | None) -> None:
        del exc
        self._closed.set()


async def _serve_child(address: str, fd: int) -> None:
    from extproc.service.server import start_accounting_server

    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    transport, _ = await loop.create_connection(
        lambda: _LinkProtocol(closed), sock=socket.socket(fileno=fd)
    )

    def write(frame: bytes) -> None:
        if not transport.is_closing():  # the parent closed the link: the child stops
            transport.write(frame)

    port = ForwardingPort(write)
    server, grpc_port = await start_accounting_server(port, address)
    transport.write(encode_frame([[READY, grpc_port]]))
    freeze_startup_heap()
    ticker = LagReporter(port)
    ticker.start()
    await closed.wait()
    ticker.stop()
    # The parent is gone: what the streams still open would report has nowhere to go, and
    # their abort by the stop is not a failure worth a traceback each.
    logging.getLogger("extproc.server").setLevel(logging.CRITICAL)
    await server.stop(0)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.service.accounting_process")
    parser.add_argument("--grpc", required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--log-format", choices=("json", "text"), default="json")
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() == 1:  # the parent died before the line above
        return 1
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(args.log_format, logging.WARNING)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        asyncio.run(_serve_child(args.grpc, args.fd))
    except OSError as error:
        log.error("cannot serve accounting on %s: %s", args.grpc, error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
