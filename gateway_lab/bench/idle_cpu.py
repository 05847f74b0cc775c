"""What an idle `extproc serve` costs in CPU (`extproc bench idle-cpu`).

Arms, started at the same time and measured over the same window (side by side, so the
machine's other load falls on all of them alike): the service with the overload monitor on
(the default policy), the same with `gateway.overload.enabled: false`, the service with its
accounting child process (`--accounting-grpc`, as the Kubernetes and mesh files run it),
and with `--before REV_OR_PATH` an older tree's service with its monitor on, alone and with its
accounting child. No request is sent; each service's user + system CPU time, its child's
included, is read from /proc at the start and the end of the window, after every arm is ready.
Their engine is an address nothing listens on, so every arm's engine poller does the same
(nothing), and the differences between the arms are the monitor and the child.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway_lab.bench.cores import tree_cpu_seconds
from gateway_lab.bench.provenance import with_provenance
from gateway_lab.bench.revisions import tree_of_rev
from gateway_lab.bench.stack import free_port
from gateway_lab.processes import http_ok

SCENARIO = "idle-cpu"
_READY_S = 60.0
_STOP_S = 10.0

POLICY = """\
version: 1
tiers: [standard]
tenants:
  acme: {tier: standard, api_keys: ["sha256:0000000000000000000000000000000000000000000000000000000000000000"]}
pools:
  short: {max_total_tokens: 8192, max_inflight: 64, max_inflight_tokens: 400000, endpoints: ["127.0.0.1:1"]}
gateway: {overload: {enabled: %s}}
"""  # noqa: E501


@dataclass
class Arm:
    name: str
    tree: Path
    monitor: bool
    accounting_child: bool = False
    process: subprocess.Popen[bytes] | None = None
    admin: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=f"results/{SCENARIO}", help="where results go")
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window")
    parser.add_argument(
        "--before",
        default=None,
        metavar="REV_OR_PATH",
        help="also measure an older service (monitor on): a tree holding extproc/, or a git rev",
    )


@contextmanager
def _serving(arm: Arm, workdir: Path) -> Iterator[Arm]:
    policy = workdir / f"{arm.name}.yaml"
    policy.write_text(POLICY % ("true" if arm.monitor else "false"))
    arm.admin = f"127.0.0.1:{free_port()}"
    log = (workdir / f"{arm.name}.log").open("wb")
    child = ["--accounting-grpc", f"127.0.0.1:{free_port()}"] if arm.accounting_child else []
    arm.process = subprocess.Popen(
        [sys.executable, "-m", "extproc.service.main", "--log-level", "WARNING",
         "--policy", str(policy), "--grpc", f"127.0.0.1:{free_port()}", "--admin", arm.admin,
         *child],
        cwd=arm.tree, env={**os.environ, "PYTHONPATH": str(arm.tree)},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()
    try:
        yield arm
    finally:
        arm.process.terminate()
        try:
            arm.process.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            arm.process.kill()
            arm.process.wait()


def _wait_ready(arms: list[Arm]) -> None:
    deadline = time.monotonic() + _READY_S
    for arm in arms:
        while not http_ok(f"http://{arm.admin}/readyz"):
            assert arm.process is not None
            if arm.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{arm.name} did not become ready (see its log)")
            time.sleep(0.1)


def measure(arms: list[Arm], seconds: float, workdir: Path) -> dict[str, dict[str, float]]:
    """Each arm's CPU seconds at the start and the end of one window (all arms at once), the
    window's length, and CPU milliseconds per second over it."""
    with ExitStack() as stack:
        for arm in arms:
            stack.enter_context(_serving(arm, workdir))
        _wait_ready(arms)
        time.sleep(2.0)  # past start-up (the first reload check, the first engine poll)
        pids = {arm.name: arm.process.pid for arm in arms if arm.process is not None}
        began = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        start = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - start
        ended = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    return {
        name: {
            "cpu_s_start": began[name],
            "cpu_s_end": ended[name],
            "window_s": elapsed,
            "cpu_ms_per_s": (ended[name] - began[name]) * 1000.0 / elapsed,
        }
        for name in pids
    }


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(__file__).resolve().parents[2]
        arms = [
            Arm("monitor-on", root, True),
            Arm("monitor-off", root, False),
            Arm("child", root, True, accounting_child=True),
        ]
        if args.before is not None:
            given = Path(args.before)
            tree = given if given.is_dir() else tree_of_rev(args.before, Path(scratch) / "tree")
            arms.append(Arm("before-monitor-on", tree, True))
            arms.append(Arm("before-child", tree, True, accounting_child=True))
        workdir = Path(scratch) / "run"
        workdir.mkdir()
        print(f"[{SCENARIO}] {len(arms)} idle services for {args.seconds:.0f} s", file=sys.stderr)
        raw = measure(arms, args.seconds, workdir)
    cpu = {name: reading["cpu_ms_per_s"] for name, reading in raw.items()}
    floor = cpu["monitor-off"]
    print(f"{'arm':<20} {'CPU ms/s':>9} {'over monitor-off':>17}")
    for name, value in cpu.items():
        print(f"{name:<20} {value:9.2f} {value - floor:+17.2f}")
    results: dict[str, Any] = {
        "scenario": SCENARIO,
        "seconds": args.seconds,
        "before": args.before,
        "cpu_ms_per_s": cpu,
        "raw": raw,
        "note": "/proc CPU time has a 10 ms tick: +-0.7 ms/s over 30 s",
    }
    (out / "results.json").write_text(json.dumps(with_provenance(results), indent=1))
    print(f"results: {out / 'results.json'}")
    return 0
