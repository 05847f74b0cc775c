"""`extproc serve`: run the ext_proc gRPC service and its admin server until signalled."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from extproc.admin import AdminServer
from extproc.policy import PolicyError, load_policy
from extproc.service.gateway import Gateway
from extproc.service.server import start_grpc_server

log = logging.getLogger("extproc.serve")


def install_event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(policy_path: str, grpc_address: str, admin_address: str) -> int:
    try:
        policy = load_policy(policy_path)
    except PolicyError as error:
        for issue in error.issues:
            print(issue, file=sys.stderr)
        return 1
    gateway = Gateway(policy)
    server, grpc_port = await start_grpc_server(gateway, grpc_address)
    admin = AdminServer(gateway)
    admin_port = await admin.start(admin_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(
        f"extproc: ext_proc gRPC on {grpc_address.rpartition(':')[0]}:{grpc_port}, "
        f"admin on http://{admin_address.rpartition(':')[0]}:{admin_port}",
        flush=True,
    )
    await stop.wait()
    admin.draining = True
    await server.stop(grace=5.0)
    await admin.stop()
    return 0


def run_serve(policy_path: str, grpc_address: str, admin_address: str) -> int:
    install_event_loop_policy()
    return asyncio.run(serve(policy_path, grpc_address, admin_address))
