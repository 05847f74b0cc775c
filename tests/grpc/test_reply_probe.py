"""The reply probe (gateway_lab.bench.reply_probe) times a real ext_proc server's headers
reply; against a server without an admin port (the do-nothing floor) it has no loop lag to
read and still prints strict JSON (`self-overload --probe` parses it)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from extproc.service.server import GRPC_SERVER_OPTIONS
from gateway_lab.bench import reply_probe
from gateway_lab.bench.noop import NoopProcessor
from tests.grpc.test_noop_mimic import _stub


async def test_times_the_headers_reply_of_each_stream() -> None:
    async for stub in _stub(NoopProcessor()):
        replies = [await reply_probe.headers_reply_ms(stub, "key") for _ in range(3)]
        assert all(0 < ms < 10_000 for ms in replies)


def test_without_an_admin_port_prints_strict_json(capsys: pytest.CaptureFixture[str]) -> None:
    async def serve_and_probe() -> None:
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

        server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            argv = ["--grpc", f"127.0.0.1:{port}", "--key", "k", "--seconds", "0.5",
                    "--interval", "0.05"]  # fmt: skip
            assert await asyncio.to_thread(reply_probe.main, argv) == 0
        finally:
            await server.stop(None)

    asyncio.run(serve_and_probe())
    printed = capsys.readouterr().out
    result = json.loads(printed, parse_constant=lambda name: pytest.fail(f"{name} in output"))
    assert result["failures"] == 0
    assert result["headers_reply_ms"]["count"] >= 3
    assert result["headers_reply_ms"]["p50"] <= result["headers_reply_ms"]["max"]
    assert result["event_loop_lag_ms"] == {"count": 0}


def test_percentiles_of_nothing_is_a_count() -> None:
    assert reply_probe.percentiles([]) == {"count": 0}
    figures = reply_probe.percentiles([3.0, 1.0, 2.0, 4.0])
    assert (figures["p50"], figures["p90"], figures["max"], figures["count"]) == (2.0, 4.0, 4.0, 4)
