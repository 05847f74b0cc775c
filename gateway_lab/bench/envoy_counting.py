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
* `noop`: Envoy through the do-nothing ext_proc server (the floor of issue 16's CPU target);
* `ours`: Envoy through our service, its accounting streams in their child process (the
  shipped layout).

Per arm, 32 clients back to back ask for 20- and then 500-token streamed responses; the CPU
of Envoy and of the ext_proc process tree, read from /proc, per request; the slope between
the two sizes is the CPU per streamed chunk. The `lua` arm's access log is then read and its
counts compared with the tokens the clients received, so the figure is of a count that is
right. Nothing here is the shipped accounting: the Lua filter tells the service nothing yet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gateway_lab.bench import scenario
from gateway_lab.bench.cores import tree_cpu_seconds
from gateway_lab.bench.overhead import bench_policy, closed_run, workload
from gateway_lab.bench.stack import PROFILE, Gateway, engine_set, gateway_stack
from gateway_lab.processes import wait_until

NAME = "envoy_counting"
DEFAULT_OUT = Path("results/envoy-counting")
ARMS = ("straight", "lua", "noop", "ours")
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


def with_counting(bootstrap: str) -> str:
    """Envoy's rendered bootstrap (JSON) with the counting filter before the router of every
    HTTP connection manager, and its count in the access log's JSON lines."""
    config = json.loads(bootstrap)
    managers = list(_managers(config))
    if not managers:
        raise ValueError("no HTTP connection manager in the bootstrap")
    for manager in managers:
        filters = manager["httpFilters"]
        filters.insert(len(filters) - 1, {
            "name": "envoy.filters.http.lua",
            "typedConfig": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "defaultSourceCode": {"inlineString": COUNTING_LUA},
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


def _cpu(gateway: Gateway) -> dict[str, float]:
    """CPU seconds of Envoy and of the ext_proc process tree (0 without one)."""
    out = {}
    for name, key in (("envoy", "envoy"), ("extproc", "front")):
        pid = gateway.pid_of(name)
        out[key] = 0.0 if pid is None else tree_cpu_seconds(pid)
    return out


def measure(gateway: Gateway, tokens: int, clients: int, seconds: float) -> dict[str, Any]:
    before, started = _cpu(gateway), time.perf_counter()
    records = asyncio.run(closed_run(gateway.url, workload(tokens), clients, seconds))
    after = _cpu(gateway)
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


def per_chunk(runs: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """CPU per streamed chunk (us) of Envoy and the front: the slope between the short and
    the long responses, each size's runs merged (total CPU over total requests)."""
    by_size: dict[int, list[Mapping[str, Any]]] = {}
    for run in runs:
        by_size.setdefault(int(run["tokens"]), []).append(run)
    short, long_ = (by_size[size] for size in SIZES)

    def per_request(group: list[Mapping[str, Any]], key: str) -> float:
        requests = sum(int(r["requests"]) for r in group) or 1
        return sum(float(r["cpu_s"][key]) for r in group) / requests * 1e6

    def events(group: list[Mapping[str, Any]]) -> float:
        requests = sum(int(r["requests"]) for r in group) or 1
        return sum(float(r["events_per_request"]) * int(r["requests"]) for r in group) / requests

    extra = events(long_) - events(short)
    out = {
        key: (per_request(long_, key) - per_request(short, key)) / extra if extra > 0 else 0.0
        for key in ("envoy", "front")
    }
    out["both"] = out["envoy"] + out["front"]
    return out


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
    check = report["lua_count"]
    print(
        f"\nthe lua arm counted {check['counted']} tokens in {check['lines']} access-log lines; "
        f"the clients received {check['received']}"
    )


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
        gateways = {
            "straight": gateway_stack(workdir / "straight", text, "straight"),
            "lua": gateway_stack(workdir / "lua", text, "straight", bootstrap_edit=with_counting),
            "noop": gateway_stack(workdir / "noop", text, "noop"),
            "ours": gateway_stack(workdir / "ours", text, "extproc", accounting_process=True),
        }
        arms = {arm: stacks.enter_context(stack) for arm, stack in gateways.items()}
        warm = {arm: measure(gateway, 20, 4, 1.0) for arm, gateway in arms.items()}
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
                    runs[arm].append(measure(arms[arm], tokens, clients, seconds))
        logged_at_least(lua_lines_before + sum(r["requests"] for r in runs["lua"]))
        counted = counted_tokens(log.read_text())[lua_lines_before:]
    received = sum(r["output_tokens"] for r in runs["lua"])
    report = {
        "scenario": NAME,
        "profile": PROFILE,
        "clients": clients,
        "seconds": seconds,
        "rounds": rounds,
        "runs": runs,
        "per_chunk_us": {arm: per_chunk(runs[arm]) for arm in ARMS},
        "lua_count": {"counted": sum(counted), "lines": len(counted), "received": received},
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
