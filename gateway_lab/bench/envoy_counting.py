"""What counting a response's tokens costs per streamed chunk when Envoy counts them itself
(its Lua filter) instead of relaying every chunk to an ext_proc server: issue 16's "counting
in Envoy where it can be exact", measured before anything is built on it.

`extproc bench envoy-counting [--rounds 2] [--seconds 15]`

Four stacks in front of the same two emulated engines (as `extproc bench overhead`), up at
once and measured in turn, the order alternating between rounds:

* `straight`: Envoy alone, the baseline;
* `lua`: Envoy with `COUNTING_LUA` before its router: it scans every response chunk as it
  passes (one token per output delta, the last `usage` object) and leaves the count in the
  stream's dynamic metadata (`gw.tokens`), which the access log prints;
* `notify`: the same script, which also tells a do-nothing HTTP receiver
  (gateway_lab/bench/event_sink.py) the count so far every `NOTIFY_EVERY` chunks, with an
  asynchronous `httpCall`: the cheapest way the service could hear a stream's progress;
* `noop`: Envoy through the do-nothing ext_proc server (the floor of issue 16's CPU target);
* `ours`: Envoy through our service, its accounting streams in their child process (the
  default layout);
* `ours-lua`: Envoy through our service, counting in Envoy (`serve --envoy-events`,
  extproc.envoy_lua): the script above, calls every `extproc.envoy_lua.EVERY` chunks to the
  service, and the end through Envoy's gRPC access log.

Per arm, 32 clients back to back ask for 20- and then 500-token streamed responses; the CPU
of Envoy and of the ext_proc process tree, read from /proc, per request; the slope between
the two sizes is the CPU per streamed chunk. The `lua` arm's access log is then read and its
counts compared with the tokens the clients received, so the figure is of a count that is
right.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from extproc.envoy_config import split_host_port
from gateway_lab.bench import scenario
from gateway_lab.bench.cores import tree_cpu_seconds
from gateway_lab.bench.overhead import bench_policy, closed_run, workload
from gateway_lab.bench.stack import PROFILE, Gateway, engine_set, free_port, gateway_stack, running
from gateway_lab.processes import Child, Stack, http_ok, wait_until

NAME = "envoy_counting"
DEFAULT_OUT = Path("results/envoy-counting")
ARMS = ("straight", "lua", "notify", "noop", "ours", "ours-lua")
NOTIFY_EVERY = 16
EVENTS_CLUSTER = "gateway_events"
SIZES = (20, 500)
TOKENS_FIELD = "lua_tokens"
LOG_WAIT_S = 15.0

COUNTING_LUA = r"""
function envoy_on_response(handle)
  local tokens = 0
  local usage = nil
  for chunk in handle:bodyChunks() do
    local text = chunk:getBytes(0, chunk:length())
    local _, deltas = string.gsub(text, '"content":"[^"]', "")
    tokens = tokens + deltas
    local at = string.find(text, '"completion_tokens":', 1, true)
    if at then
      usage = tonumber(string.match(text, "^%s*(%d+)", at + 20))
    end
    handle:streamInfo():dynamicMetadata():set("gw", "tokens", usage or tokens)
  end
end
"""
"""Counts what passes: the engine's own `usage.completion_tokens` when the stream carries it,
otherwise one token per chunk with non-empty `content` (vLLM sends about one per chunk).
`bodyChunks()` hands each chunk over as it passes, without buffering the response. The count
is stored after every chunk: a client that leaves mid-stream ends the script where it
stands (Envoy runs no more of it), and the access log then shows what had passed."""


def notifying_lua(every: int) -> str:
    """`COUNTING_LUA` that also posts the count so far to `EVENTS_CLUSTER` every `every`
    chunks, without waiting for the answer."""
    call = (
        f"    chunks = chunks + 1\n"
        f"    if chunks % {every} == 0 then\n"
        f'      handle:httpCall("{EVENTS_CLUSTER}", {{[":method"] = "POST", '
        f'[":path"] = "/events", [":authority"] = "events"}}, tostring(usage or tokens), '
        f"1000, true)\n"
        f"    end\n"
    )
    script = COUNTING_LUA.replace(
        "  local usage = nil\n", "  local usage = nil\n  local chunks = 0\n"
    )
    return script.replace("  end\nend\n", call + "  end\nend\n")


def with_counting(bootstrap: str, events: str | None = None) -> str:
    """Envoy's rendered bootstrap (JSON) with the counting filter before the router of every
    HTTP connection manager, and its count in the access log's JSON lines; with `events`
    (HOST:PORT), the notifying script and a cluster for it."""
    config = json.loads(bootstrap)
    script = COUNTING_LUA
    if events is not None:
        script = notifying_lua(NOTIFY_EVERY)
        host, port = split_host_port(events)
        endpoint = {"address": {"socketAddress": {"address": host, "portValue": port}}}
        config["staticResources"]["clusters"].append({
            "name": EVENTS_CLUSTER, "type": "STATIC", "connectTimeout": "1s",
            "loadAssignment": {"clusterName": EVENTS_CLUSTER,
                               "endpoints": [{"lbEndpoints": [{"endpoint": endpoint}]}]},
        })  # fmt: skip
    managers = list(_managers(config))
    if not managers:
        raise ValueError("no HTTP connection manager in the bootstrap")
    for manager in managers:
        filters = manager["httpFilters"]
        filters.insert(len(filters) - 1, {
            "name": "envoy.filters.http.lua",
            "typedConfig": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "defaultSourceCode": {"inlineString": script},
            },
        })  # fmt: skip
        for log in manager.get("accessLog", []):
            fields = log["typedConfig"]["logFormat"]["jsonFormat"]
            fields[TOKENS_FIELD] = "%DYNAMIC_METADATA(gw:tokens)%"
    return json.dumps(config)


def _managers(node: Any) -> Iterable[dict[str, Any]]:
    if isinstance(node, dict):
        if isinstance(node.get("httpFilters"), list):
            yield node
        for value in node.values():
            yield from _managers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _managers(value)


def counted_tokens(log_text: str) -> list[int]:
    """The counts the access log's JSON lines carry (lines without one are skipped)."""
    counts = []
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        value = json.loads(line).get(TOKENS_FIELD)
        if isinstance(value, (int, float)) or (isinstance(value, str) and value.isdigit()):
            counts.append(int(value))
    return counts


def _cpu(gateway: Gateway, front: int | None) -> dict[str, float]:
    """CPU seconds of Envoy and of the process tree behind it (the ext_proc server, or
    `front`: the event receiver), 0 without one."""
    envoy = gateway.pid_of("envoy")
    front = gateway.pid_of("extproc") if front is None else front
    return {
        "envoy": 0.0 if envoy is None else tree_cpu_seconds(envoy),
        "front": 0.0 if front is None else tree_cpu_seconds(front),
    }


def measure(
    gateway: Gateway, tokens: int, clients: int, seconds: float, front: int | None = None
) -> dict[str, Any]:
    before, started = _cpu(gateway, front), time.perf_counter()
    records = asyncio.run(closed_run(gateway.url, workload(tokens), clients, seconds))
    after = _cpu(gateway, front)
    ok = [r for r in records if r.status == 200 and r.complete]
    return {
        "tokens": tokens,
        "requests": len(ok),
        "failed": sum(1 for r in records if r.status != 200),
        "output_tokens": sum(r.output_tokens for r in ok),
        "events_per_request": sum(r.events for r in ok) / max(1, len(ok)),
        "elapsed_s": time.perf_counter() - started,
        "cpu_s": {key: after[key] - before[key] for key in after},
    }


def _by_size(runs: Iterable[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    by_size: dict[int, list[Mapping[str, Any]]] = {}
    for run in runs:
        by_size.setdefault(int(run["tokens"]), []).append(run)
    return by_size


def _cpu_us_per_request(group: list[Mapping[str, Any]], keys: Iterable[str]) -> float:
    """The group's runs merged: total CPU of `keys` over total requests, in us."""
    requests = sum(int(r["requests"]) for r in group) or 1
    return sum(float(r["cpu_s"][key]) for r in group for key in keys) / requests * 1e6


def per_chunk(runs: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """CPU per streamed chunk (us) of Envoy and the front: the slope between the short and
    the long responses, each size's runs merged (total CPU over total requests)."""
    by_size = _by_size(runs)
    short, long_ = (by_size[size] for size in SIZES)

    def events(group: list[Mapping[str, Any]]) -> float:
        requests = sum(int(r["requests"]) for r in group) or 1
        return sum(float(r["events_per_request"]) * int(r["requests"]) for r in group) / requests

    extra = events(long_) - events(short)
    out = {
        key: (_cpu_us_per_request(long_, [key]) - _cpu_us_per_request(short, [key])) / extra
        if extra > 0
        else 0.0
        for key in ("envoy", "front")
    }
    out["both"] = out["envoy"] + out["front"]
    return out


def served_output_tokens(gateway: Gateway) -> int:
    """The output tokens the service has settled, all tenants (`extproc_tokens_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    assert gateway.admin_url is not None
    with urllib.request.urlopen(f"{gateway.admin_url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return round(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "extproc_tokens_total" and sample.labels["direction"] == "output"
        )
    )


def per_request(runs: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """CPU per request (us) of Envoy and the front together, by response size."""
    return {
        size: _cpu_us_per_request(group, ("envoy", "front"))
        for size, group in sorted(_by_size(runs).items())
    }


def print_table(report: Mapping[str, Any]) -> None:
    rows = report["per_chunk_us"]
    base = rows["straight"]["both"]
    print("\nCPU per streamed chunk (us), Envoy + the ext_proc process tree:")
    print(f"{'arm':10} {'envoy':>8} {'front':>8} {'both':>8} {'above straight':>15}")
    for arm, row in rows.items():
        print(
            f"{arm:10} {row['envoy']:>8.1f} {row['front']:>8.1f} {row['both']:>8.1f} "
            f"{row['both'] - base:>15.1f}"
        )
    requests = report["per_request_us"]
    floor = requests["noop"]
    print("\nCPU per request (us), Envoy + the ext_proc process tree, and x the noop floor:")
    for arm, row in requests.items():
        cells = "  ".join(
            f"{size} tokens {row[str(size)]:>8.0f} ({row[str(size)] / floor[str(size)]:.2f}x)"
            for size in SIZES
        )
        print(f"{arm:10} {cells}")
    served = report["ours_lua_count"]
    print(
        f"\nours-lua: the service settled {served['settled']} output tokens; "
        f"the clients received {served['received']}"
    )
    check = report["lua_count"]
    print(
        f"\nthe lua arm counted {check['counted']} tokens in {check['lines']} access-log lines; "
        f"the clients received {check['received']}"
    )
    notify = report["notify"]
    print(
        f"the notify arm's receiver got {notify['events_received']} events for "
        f"{notify['chunks_sent']:.0f} chunks (one per {notify['every_chunks']} chunks of each "
        "response)"
    )


@contextlib.contextmanager
def event_sink(workdir: Path) -> Iterator[tuple[str, int]]:
    """The event receiver on a fresh loopback port: its address and pid."""
    workdir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "gateway_lab.bench.event_sink", "--listen", address]
    child = Child(name="event-sink", command=command, log_path=workdir / "sink.log")
    check = (functools.partial(http_ok, f"http://{address}/count"), "event sink")
    with running(Stack(children=[child]), [check]):
        assert child.process is not None
        yield address, child.process.pid


def received_events(address: str) -> int:
    with urllib.request.urlopen(f"http://{address}/count", timeout=5) as answer:
        return int(answer.read())


def plot(report: Mapping[str, Any], path: Path) -> None:
    from gateway_lab.bench.figures import pyplot, save_figure

    plt = pyplot()
    rows = report["per_chunk_us"]
    fig, ax = plt.subplots(figsize=(7, 4))
    arms = list(rows)
    envoy = [rows[arm]["envoy"] for arm in arms]
    ax.bar(arms, envoy, label="Envoy")
    ax.bar(arms, [rows[arm]["front"] for arm in arms], bottom=envoy, label="ext_proc server")
    ax.set_ylabel("CPU per streamed chunk (us)")
    ax.set_title("counting tokens: in Envoy (Lua) or through ext_proc")
    ax.legend()
    save_figure(fig, path)


def run(out: Path, rounds: int, seconds: float, clients: int) -> dict[str, Any]:
    workdir = out / "work"
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with contextlib.ExitStack() as stacks:
        engines = stacks.enter_context(engine_set(workdir / "engines", {"short": 1, "long": 1}))
        text = bench_policy(engines.endpoints["short"][0], engines.endpoints["long"][0])
        events, sink = stacks.enter_context(event_sink(workdir / "sink"))
        notifying = functools.partial(with_counting, events=events)
        gateways = {
            "straight": gateway_stack(workdir / "straight", text, "straight"),
            "lua": gateway_stack(workdir / "lua", text, "straight", bootstrap_edit=with_counting),
            "notify": gateway_stack(workdir / "notify", text, "straight", bootstrap_edit=notifying),
            "noop": gateway_stack(workdir / "noop", text, "noop"),
            "ours": gateway_stack(workdir / "ours", text, "extproc", accounting_process=True),
            "ours-lua": gateway_stack(workdir / "ours-lua", text, "extproc", count_in_envoy=True),
        }
        arms = {arm: stacks.enter_context(stack) for arm, stack in gateways.items()}
        fronts = {"notify": sink}
        warm = {arm: measure(gateway, 20, 4, 1.0, fronts.get(arm)) for arm, gateway in arms.items()}
        events_before = received_events(events)
        settled_before = served_output_tokens(arms["ours-lua"])
        log, lua_stack = workdir / "lua" / "envoy.log", arms["lua"].stack

        def logged_at_least(lines: int) -> None:
            # Envoy writes its access log in batches: wait for the lines of every answer.
            wait_until(lambda: len(counted_tokens(log.read_text())) >= lines, lua_stack,
                       "the lua arm's access log", LOG_WAIT_S)  # fmt: skip

        lua_lines_before = warm["lua"]["requests"]
        logged_at_least(lua_lines_before)
        for turn in range(rounds):
            for arm in ARMS if turn % 2 == 0 else ARMS[::-1]:  # drift hits every arm alike
                for tokens in SIZES:
                    runs[arm].append(measure(arms[arm], tokens, clients, seconds, fronts.get(arm)))
        logged_at_least(lua_lines_before + sum(r["requests"] for r in runs["lua"]))
        counted = counted_tokens(log.read_text())[lua_lines_before:]
        notified = received_events(events) - events_before
        served = sum(r["output_tokens"] for r in runs["ours-lua"])
        ours_lua = arms["ours-lua"]
        deadline = time.monotonic() + LOG_WAIT_S  # a count that never matches is reported
        while (settled := served_output_tokens(ours_lua) - settled_before) < served:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    received = sum(r["output_tokens"] for r in runs["lua"])
    report = {
        "scenario": NAME,
        "profile": PROFILE,
        "clients": clients,
        "seconds": seconds,
        "rounds": rounds,
        "runs": runs,
        "per_chunk_us": {arm: per_chunk(runs[arm]) for arm in ARMS},
        "per_request_us": {
            arm: {str(size): cpu for size, cpu in per_request(runs[arm]).items()} for arm in ARMS
        },
        "ours_lua_count": {"settled": settled, "received": served},
        "lua_count": {"counted": sum(counted), "lines": len(counted), "received": received},
        "notify": {
            "every_chunks": NOTIFY_EVERY,
            "events_received": notified,
            "chunks_sent": sum(r["events_per_request"] * r["requests"] for r in runs["notify"]),
        },
    }
    scenario.save_results(
        out, report, "envoy-counting.png", lambda path: plot(report, path),
        lambda: print_table(report),
    )  # fmt: skip
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0, help="per arm and size")
    parser.add_argument("--clients", type=int, default=32)


def main(args: argparse.Namespace) -> int:
    run(args.out, args.rounds, args.seconds, args.clients)
    return 0


if __name__ == "__main__":
    raise SystemExit(
        scenario.script_main(f"gateway_lab.bench.{NAME}", __doc__, add_arguments, main)
    )
