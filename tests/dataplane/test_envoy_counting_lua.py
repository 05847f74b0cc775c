"""The counting Lua filter of `python -m gateway_lab.bench.envoy_counting` in the real Envoy, in
front of an emulated engine: its count of each streamed response is the tokens the client
received, with the engine's final usage chunk and without it; a client that leaves
mid-stream leaves the count of what had passed. The notifying script's calls from inside the
chunk loop reach their receiver."""

from __future__ import annotations

import functools
import json
import urllib.request
from pathlib import Path

import pytest

from gateway_lab.bench.envoy_counting import (
    NOTIFY_EVERY,
    counted_tokens,
    event_sink,
    received_events,
    with_counting,
)
from gateway_lab.bench.loadgen import TokenEvents
from gateway_lab.bench.overhead import bench_policy
from gateway_lab.bench.stack import engine_set, gateway_stack
from gateway_lab.processes import wait_until

pytestmark = pytest.mark.dataplane


def _stream(
    url: str, max_tokens: int, usage: bool, request_id: str, leave_after: int | None = None
) -> int:
    """One streamed chat completion; the output tokens the client counted (leaving once it
    has `leave_after`, if given)."""
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Count to a few hundred, slowly."}],
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        url,
        json.dumps(body).encode(),
        {"content-type": "application/json", "x-request-id": request_id},
    )
    counter, tokens = TokenEvents(), 0
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200
        while chunk := answer.read1(65536):
            tokens += counter.feed(chunk)
            if leave_after is not None and tokens >= leave_after:
                break  # closing the response closes the connection mid-stream
    return tokens


def test_the_lua_count_of_each_response_is_what_the_client_received(tmp_path: Path) -> None:
    with engine_set(tmp_path / "engines", {"short": 1, "long": 1}) as engines:
        text = bench_policy(engines.endpoints["short"][0], engines.endpoints["long"][0])
        with gateway_stack(tmp_path / "lua", text, "straight", bootstrap_edit=with_counting) as gw:
            received = {
                f"r{n}": _stream(gw.url, max_tokens, usage, f"r{n}")
                for n, (max_tokens, usage) in enumerate([(7, False), (40, True), (23, False)])
            }
            log = tmp_path / "lua" / "envoy.log"

            def lines() -> dict[str, int]:
                found = {}
                for line in log.read_text().splitlines():
                    if line.startswith("{") and counted_tokens(line):
                        found[json.loads(line)["request_id"]] = counted_tokens(line)[0]
                return found

            # Envoy writes its access log in batches.
            wait_until(lambda: set(received) <= set(lines()), gw.stack, "access log", 15.0)
            assert {rid: lines()[rid] for rid in received} == received
            assert received == {"r0": 7, "r1": 40, "r2": 23}

            read = _stream(gw.url, 400, False, "left", leave_after=10)
            wait_until(lambda: "left" in lines(), gw.stack, "access log", 15.0)
            # What passed Envoy before it saw the client go: at least what the client read.
            assert read <= lines()["left"] < 400


def test_the_notifying_script_reaches_its_receiver_while_the_stream_flows(tmp_path: Path) -> None:
    with (
        engine_set(tmp_path / "engines", {"short": 1, "long": 1}) as engines,
        event_sink(tmp_path / "sink") as (events, _pid),
    ):
        text = bench_policy(engines.endpoints["short"][0], engines.endpoints["long"][0])
        edit = functools.partial(with_counting, events=events)
        with gateway_stack(tmp_path / "notify", text, "straight", bootstrap_edit=edit) as gw:
            assert _stream(gw.url, 160, False, "n1") == 160
            # One call per NOTIFY_EVERY body chunks (about one event each, fewer when Envoy
            # reads two at once); the calls do not hold the response, so they may land after it.
            wait_until(lambda: received_events(events) >= 1, gw.stack, "events", 15.0)
            assert received_events(events) <= (160 + 3) // NOTIFY_EVERY
