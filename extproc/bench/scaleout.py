"""Benchmark: admissions per second and added latency with 1, 2 and 4 service processes, with
the memory store and with the Redis store, side by side in one run.

`extproc bench scaleout [--out results/scaleout] [--processes 1,2,4] [--stores memory,redis]
[--duration 6] [--concurrency 64] [--quick]`

Each arm starts `extproc serve --workers N --worker-ports distinct` (the supervisor of
extproc.service.workers; memory arms with --allow-unshared-workers) and, for Redis, a private
redis-server on a loopback port. Load processes play Envoy's admission filter over gRPC:
request headers, then the buffered body, read the admission reply (through the hold, if any),
then close the stream, spread round-robin over the workers' ports. Limits and capacity are
generous, so every request is admitted: the numbers are the cost of deciding, not of waiting.
Latency is from sending the request headers to the admission reply. Nothing but loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from extproc.bench.loadgen import percentile
from extproc.bench.stack import cpu_seconds, free_port
from extproc.policy import hash_key

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
    parser.add_argument("--load-processes", type=int, default=2, help="load generator processes")
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


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _wait(check: Any, what: str, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + _READY_S
    delay = 0.02
    while not check():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


@dataclass(frozen=True)
class RedisUnderTest:
    url: str
    pid: int


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[RedisUnderTest]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        _wait(lambda: _redis_ping(port), "redis-server", process)
        yield RedisUnderTest(f"redis://127.0.0.1:{port}/0", process.pid)
    finally:
        process.terminate()
        process.wait(10)


def _redis_ping(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def service(policy: Path, workers: int, store: str, workdir: Path) -> Iterator[list[str]]:
    """`extproc serve --workers N` with distinct ports; yields the workers' gRPC addresses."""
    grpc_base, admin_base = _free_run(workers), _free_run(workers)
    command = [
        sys.executable, "-m", "extproc.service.workers", "--workers", str(workers),
        "--worker-ports", "distinct", "--policy", str(policy),
        "--grpc", f"127.0.0.1:{grpc_base}", "--admin", f"127.0.0.1:{admin_base}",
        "--log-format", "text", "--reload-interval", "0", "--drain-grace", "1",
    ]  # fmt: skip
    if store == "memory":
        command.append("--allow-unshared-workers")
    log = (workdir / f"serve-{store}-{workers}.log").open("wb")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    log.close()
    try:
        for i in range(workers):
            url = f"http://127.0.0.1:{admin_base + i}/readyz"
            _wait(lambda u=url: _http_ok(u), f"worker {i}", process)
        yield [f"127.0.0.1:{grpc_base + i}" for i in range(workers)]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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


@dataclass(frozen=True)
class LoadPlan:
    addresses: list[str]
    streams: int
    warmup_s: float
    duration_s: float
    offset: int


def _load_main(plan: LoadPlan, results: Any) -> None:
    """One load process: `streams` closed loops; puts (admitted, errors, latencies) on done."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    results.put(runner(_load(plan)))


async def _load(plan: LoadPlan) -> tuple[int, int, list[float]]:
    import grpc
    from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
    from envoy.service.ext_proc.v3.external_processor_pb2 import (
        HttpBody,
        HttpHeaders,
        ProcessingRequest,
    )

    channels = [
        grpc.aio.insecure_channel(a, options=[("grpc.use_local_subchannel_pool", 1)])
        for a in plan.addresses
    ]
    stubs = [ext_proc_grpc.ExternalProcessorStub(c) for c in channels]
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "Say hello. " * 20}],
         "max_tokens": 64}
    )  # fmt: skip
    bodies = ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))
    headers = [
        ProcessingRequest(
            request_headers=HttpHeaders(
                headers=HeaderMap(
                    headers=[
                        HeaderValue(key=k, raw_value=v.encode())
                        for k, v in _request_headers(tenant, len(body))
                    ]
                )
            )
        )
        for tenant in TENANTS
    ]
    began = time.monotonic()
    measure_from = began + plan.warmup_s
    stop_at = measure_from + plan.duration_s
    latencies: list[float] = []
    counts = [0, 0]

    async def loop(index: int) -> None:
        n = index
        while time.monotonic() < stop_at:
            stub = stubs[(plan.offset + n) % len(stubs)]
            n += 1
            sent = time.monotonic()
            call = stub.Process()
            try:
                await call.write(headers[n % len(headers)])
                await call.read()
                await call.write(bodies)
                reply = await call.read()
                if reply.HasField("override_message_timeout"):
                    reply = await call.read()
                done = time.monotonic()
                ok = reply.HasField("request_body")
            except grpc.aio.AioRpcError:
                ok, done = False, time.monotonic()
            finally:
                call.cancel()
            if sent >= measure_from and done <= stop_at:
                counts[0 if ok else 1] += 1
                if ok:
                    latencies.append(done - sent)

    await asyncio.gather(*(loop(i) for i in range(plan.streams)))
    for channel in channels:
        await channel.close()
    return counts[0], counts[1], latencies


def _request_headers(tenant: str, length: int) -> list[tuple[str, str]]:
    return [
        (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "bench"),
        ("authorization", f"Bearer {tenant}"), ("content-type", "application/json"),
        ("content-length", str(length)),
    ]  # fmt: skip


def run_load(
    addresses: list[str], concurrency: int, processes: int, warmup: float, duration: float
) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    per = max(1, concurrency // processes)
    workers = [
        context.Process(
            target=_load_main,
            args=(LoadPlan(addresses, per, warmup, duration, offset=i), results),
        )
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    admitted = errors = 0
    latencies: list[float] = []
    for _ in workers:
        ok, failed, samples = results.get(timeout=warmup + duration + 120)
        admitted += ok
        errors += failed
        latencies += samples
    for worker in workers:
        worker.join(30)
    return {
        "admitted": admitted,
        "errors": errors,
        "admissions_per_s": admitted / duration,
        "latency_p50_ms": percentile(latencies, 50) * 1000,
        "latency_p95_ms": percentile(latencies, 95) * 1000,
        "latency_p99_ms": percentile(latencies, 99) * 1000,
    }


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
    with service(policy, workers, store, workdir) as addresses:
        redis_cpu = cpu_seconds(shared.pid) if shared is not None else 0.0
        heavy = run_load(
            addresses, args.concurrency, args.load_processes, args.warmup, args.duration
        )
        if shared is not None:
            # Redis CPU per admission (whole run, warm-up included: counted over all requests
            # the load generator completed, so a slight overestimate).
            used = cpu_seconds(shared.pid) - redis_cpu
            total = heavy["admissions_per_s"] * (args.duration + args.warmup)
            heavy["redis_cpu_us_per_admission"] = used / max(1.0, total) * 1e6
        light = run_load(addresses, args.light, 1, args.warmup / 2, args.duration / 2)
    result: dict[str, Any] = {"store": store, "processes": workers}
    result.update({k: v for k, v in heavy.items() if not k.startswith("latency")})
    result.update({f"saturated_{k}": v for k, v in heavy.items() if k.startswith("latency")})
    result.update({k: v for k, v in light.items() if k.startswith("latency")})
    result["light_admissions_per_s"] = light["admissions_per_s"]
    return result


def table(results: list[dict[str, Any]]) -> str:
    header = (
        f"{'store':<8}{'procs':>6}{'adm/s':>10}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}"
        f"{'sat p50':>9}{'sat p99':>9}{'redis us':>10}"
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
            f"{r.get('redis_cpu_us_per_admission', math.nan):>10.0f}"
        )
    lines.append(
        "adm/s: saturated (closed loop at --concurrency); p50/p95/p99: added latency at --light "
        "streams; sat: latency at saturation (mostly queueing); redis us: Redis CPU per admission"
    )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.duration, args.warmup = min(args.duration, 2.0), min(args.warmup, 0.5)
    processes = [int(p) for p in str(args.processes).split(",") if p.strip()]
    stores = [s.strip() for s in str(args.stores).split(",") if s.strip()]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="extproc-scaleout-") as tmp:
        workdir = Path(tmp)
        with contextlib.ExitStack() as stack:
            redis: RedisUnderTest | None = None
            if "redis" in stores:
                try:
                    redis = stack.enter_context(redis_server(workdir))
                except RuntimeError as error:
                    print(f"redis arms skipped: {error}", file=sys.stderr)
            for workers in processes:
                for store in stores:
                    if store == "redis" and redis is None:
                        results.append({"store": store, "processes": workers,
                                        "skipped": "no redis-server"})  # fmt: skip
                        continue
                    print(f"[scaleout] {store} x {workers} ...", file=sys.stderr, flush=True)
                    results.append(run_arm(store, workers, args, workdir, redis))
    meta = {
        "cores": os.cpu_count(),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "concurrency": args.concurrency,
        "light_concurrency": args.light,
        "load_processes": args.load_processes,
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
