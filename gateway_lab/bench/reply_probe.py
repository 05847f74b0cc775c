"""How long the ext_proc server itself takes to answer, measured from outside Envoy.

Envoy's access log says how long Envoy waited for each ext_proc reply, but not whether the
time went to the server, to Envoy or to a core both wait for. The probe plays Envoy on a gRPC
channel of its own, from another core (the engine's, in `self-overload`): every `interval_s`
it opens a Process stream, sends the request-headers message of a tenant's request and times
the reply, then cancels the stream. The headers reply is the first thing a new stream gets, so
the figure covers accepting the stream too; nothing is admitted, nothing reaches an engine.
While it runs it also reads the service's event-loop lag from its /metrics (when an admin
address is given): a late loop and a late reply are different findings.

`python -m gateway_lab.bench.reply_probe --grpc ADDR --key KEY --seconds S [--admin ADDR]`
prints one JSON object; `self-overload --probe` runs it per arm (`run_beside`), pinned to the
engine's core, and prints it beside Envoy's waits (`print_door`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any

import aiohttp
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest

from extproc.service.processor import http_headers
from gateway_lab.bench.cores import pin
from gateway_lab.bench.records import percentile
from gateway_lab.bench.stats import fmt

INTERVAL_S = 0.25
REPLY_TIMEOUT_S = 10.0
_LAG = re.compile(r"^extproc_event_loop_lag_seconds\s+(\S+)$", re.MULTILINE)


def percentiles(values: list[float]) -> dict[str, float]:
    """count, p50, p90, p99 and max of `values` (nearest rank); just the count when empty,
    so the output stays strict JSON."""
    if not values:
        return {"count": 0}
    summary = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    return {"count": len(values), **summary, "max": max(values)}


async def headers_reply_ms(stub: Any, key: str, path: str = "/v1/completions") -> float:
    """One stream: the request-headers message of a streamed completion, timed to its reply."""
    message = ProcessingRequest(
        request_headers=http_headers(
            [(":method", "POST"), (":path", path), ("authorization", f"Bearer {key}"),
             ("content-type", "application/json"), ("content-length", "64")]
        )
    )  # fmt: skip
    call = stub.Process()
    try:
        began = time.perf_counter()
        await call.write(message)
        await asyncio.wait_for(call.read(), REPLY_TIMEOUT_S)
        return (time.perf_counter() - began) * 1000.0
    finally:
        call.cancel()


async def loop_lag_ms(session: aiohttp.ClientSession, admin: str) -> float | None:
    async with session.get(f"http://{admin}/metrics") as response:
        match = _LAG.search(await response.text())
    return None if match is None else float(match.group(1)) * 1000.0


async def probe(
    grpc_address: str, key: str, seconds: float, admin: str | None = None,
    interval_s: float = INTERVAL_S,
) -> dict[str, Any]:  # fmt: skip
    replies: list[float] = []
    lags: list[float] = []
    failures = 0
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with (
        grpc.aio.insecure_channel(grpc_address) as channel,
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        await asyncio.wait_for(channel.channel_ready(), REPLY_TIMEOUT_S)
        while time.monotonic() < deadline:
            try:
                replies.append(await headers_reply_ms(stub, key))
            except (grpc.aio.AioRpcError, TimeoutError):
                failures += 1
            if admin is not None:
                try:
                    lag = await loop_lag_ms(session, admin)
                except (aiohttp.ClientError, TimeoutError):
                    lag = None
                if lag is not None:
                    lags.append(lag)
            await asyncio.sleep(interval_s)
    return {
        "headers_reply_ms": percentiles(replies),
        "failures": failures,
        "event_loop_lag_ms": percentiles(lags),
    }


async def run_beside(
    grpc_address: str, admin_url: str | None, key: str, seconds: float,
    cores: frozenset[int] | None,
) -> dict[str, Any] | None:  # fmt: skip
    """The probe for `seconds` in a process of its own on `cores` (so it takes no CPU from
    the server it times); None if it failed."""
    command = [sys.executable, "-m", __name__, "--grpc", grpc_address, "--key", key,
               "--seconds", str(seconds)]  # fmt: skip
    if admin_url is not None:
        command += ["--admin", admin_url.removeprefix("http://")]
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    if cores is not None:
        pin(process.pid, cores)
    out, _ = await asyncio.wait_for(process.communicate(), seconds + 30.0)
    if process.returncode != 0:
        print(f"reply probe failed (exit {process.returncode})", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(out)
    return result


_HEADERS_WAIT = "ext_proc_request_header_latency_us"
_BODY_WAIT = "ext_proc_request_body_total_latency_us"


def print_door(results: dict[str, dict[str, Any]]) -> None:
    """Per arm with an ext_proc server: how long Envoy waited for the quiet tenant's replies
    (`quiet_ext_proc_waits_ms`, from the access log), against how long the server took to
    answer the probe's headers, and its loop's lag."""
    door = {n: r for n, r in results.items() if r.get("quiet_ext_proc_waits_ms")}
    if not door:
        return

    def cell(figures: dict[str, Any] | None, low: str = "p50", high: str = "p90") -> str:
        if not figures or not figures.get("count"):
            return "-"
        return f"{fmt(figures[low])} / {fmt(figures[high])}"

    print("\nthe door's replies, ms p50 / p90 (probe: from the engine's core; lag: p50 / max):")
    print(f"{'arm':20} {'Envoy waits: headers':>21} {'body':>15} {'probe: headers':>15} "
          f"{'loop lag':>13}")  # fmt: skip
    for name, result in door.items():
        waits = result["quiet_ext_proc_waits_ms"]
        probe_ = result.get("reply_probe") or {}
        print(
            f"{name:20} {cell(waits.get(_HEADERS_WAIT)):>21} {cell(waits.get(_BODY_WAIT)):>15} "
            f"{cell(probe_.get('headers_reply_ms')):>15} "
            f"{cell(probe_.get('event_loop_lag_ms'), 'p50', 'max'):>13}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc", required=True, help="the ext_proc server's address")
    parser.add_argument("--key", required=True, help="a tenant's API key")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--admin", help="the service's admin address (event-loop lag)")
    parser.add_argument("--interval", type=float, default=INTERVAL_S)
    args = parser.parse_args(argv)
    result = asyncio.run(probe(args.grpc, args.key, args.seconds, args.admin, args.interval))
    json.dump(result, sys.stdout, allow_nan=False)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
