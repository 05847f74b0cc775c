"""The service's own Python cost for one request, without gRPC: both processors driven with
prebuilt Envoy messages, phase by phase, in a hot loop.

`python -m gateway_lab.bench.inprocess [--requests 10000] [--chunks 23]`

This isolates what our code costs from what gRPC in Python costs (the do-nothing floor of
`extproc bench overhead`). In the real service the same code runs about 2.4x slower than here
(measured with thread-time counters around the handlers: cold caches between gRPC's work),
so read these figures as relative: they show which phase to work on and whether a change
made the code cheaper, not what a request costs in production.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import orjson
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody

from extproc.policy import load_policy
from extproc.service.accounting import AccountingProcessor
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.processor import AdmissionProcessor, http_headers
from gateway_lab.bench.overhead import BENCH_KEY, bench_policy

PHASES = (
    "request headers",
    "request body (admission)",
    "admission stream end",
    "accounting headers",
    "output chunks",
    "usage chunk + settle",
)


class OneRequest:
    """The messages Envoy sends for one streamed chat completion of `chunks` body chunks."""

    def __init__(self, chunks: int) -> None:
        body = orjson.dumps(
            {"model": "bench", "max_tokens": 20, "stream": True,
             "stream_options": {"include_usage": True},
             "messages": [{"role": "user", "content": "Summarise fair scheduling. " * 3}]}
        )  # fmt: skip
        self.request_headers = http_headers(
            [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gateway"),
             (":scheme", "http"), ("authorization", f"Bearer {BENCH_KEY}"),
             ("content-type", "application/json"), ("content-length", str(len(body))),
             ("user-agent", "bench"), ("x-forwarded-proto", "http"), ("x-request-id", "r1")]
        )  # fmt: skip
        self.request_body = HttpBody(body=body, end_of_stream=True)
        self.response_headers = http_headers(
            [(":status", "200"), ("content-type", "text/event-stream"), ("server", "engine")]
        )
        delta = (
            b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"bench",'
            b'"choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n'
        )
        usage = (
            b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"bench",'
            b'"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":20,'
            b'"total_tokens":50}}\n\n'
        )
        self.output_chunks = [HttpBody(body=delta) for _ in range(max(0, chunks - 2))]
        self.output_chunks.append(HttpBody(body=usage))
        self.last_chunk = HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)


async def _run_one(gateway: Gateway, request: OneRequest, totals: dict[str, float]) -> None:
    clock = time.perf_counter
    t0 = clock()
    admission = AdmissionProcessor(gateway)
    admission.on_request_headers(request.request_headers)
    t1 = clock()
    async for _reply in admission.on_request_body(request.request_body):
        pass
    t2 = clock()
    admission.finish()
    t4 = clock()
    linked = http_headers([(":path", "/v1/chat/completions"),
                       ("x-gateway-request-id", admission.state.request_id)])  # fmt: skip
    t5 = clock()
    accounting = AccountingProcessor(gateway)
    accounting.on_request_headers(linked)
    accounting.on_response_headers(request.response_headers)
    t6 = clock()
    for chunk in request.output_chunks[:-1]:
        accounting.on_response_body(chunk)
    t7 = clock()
    accounting.on_response_body(request.output_chunks[-1])
    accounting.on_response_body(request.last_chunk)
    t8 = clock()
    for phase, spent in zip(
        PHASES, (t1 - t0, t2 - t1, t4 - t2, t6 - t5, t7 - t6, t8 - t7), strict=True
    ):
        totals[phase] += spent


async def measure(requests: int, chunks: int) -> dict[str, float]:
    """Microseconds per request by phase (after a warm-up of requests / 4)."""
    with tempfile.TemporaryDirectory(prefix="extproc-inprocess-") as tmp:
        path = Path(tmp) / "policy.yaml"
        path.write_text(bench_policy("127.0.0.1:1", "127.0.0.1:2"))
        gateway = compose(load_policy(path))
    request = OneRequest(chunks)
    totals: dict[str, float] = defaultdict(float)
    for _ in range(max(1, requests // 4)):
        await _run_one(gateway, request, totals)
    totals.clear()
    for _ in range(requests):
        await _run_one(gateway, request, totals)
    result = {phase: totals[phase] / requests * 1e6 for phase in PHASES}
    result["total"] = sum(result[phase] for phase in PHASES)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--chunks", type=int, default=23, help="body chunks per response")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args.requests, args.chunks))
    if args.json:
        print(json.dumps(result))
        return 0
    for phase, micros in result.items():
        print(f"{phase:28s} {micros:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
