"""`extproc serve --workers N`: N service processes under one supervisor.

Python serves one gRPC stream at a time per core; more cores need more processes. The
supervisor starts N workers (each a complete `extproc serve`: gRPC, admin, reload, drain) and
restarts any that dies, with backoff. Two ways to spread streams over them:

* `--worker-ports shared` (default): every worker listens on the same gRPC address with
  SO_REUSEPORT and the kernel spreads *connections* over them. Good with many clients (several
  Envoys, or Envoy with `--concurrency` > 1: one connection per Envoy worker thread); a single
  Envoy connection lands on a single worker.
* `--worker-ports distinct`: worker i listens on port + i; list all of them as endpoints of
  Envoy's ext_proc cluster and Envoy spreads *streams* (requests) evenly.

Worker i's admin server is on the admin port + i (worker 0 on the given address).

The admission and the accounting stream of one HTTP request may reach different workers, so
workers must share state: `state.backend: redis`. With the memory store each worker would
enforce every limit on its own (N workers = N times the limits) and settle only the requests
whose two streams met on it; the supervisor refuses that unless `--allow-unshared-workers`.

With `--envoy-events` (Envoy counts the responses) worker i listens for Envoy's counting calls
on that port + i too, and needs `--worker-ports distinct`: its request ids name it, and Envoy
sends each request's calls and its end to the worker that admitted it (`check_envoy_events`,
extproc.envoy_lua). Streams of one request never meet another worker then.

`--accounting-grpc` (accounting in a child process) is refused with N > 1 (`check_accounting`):
that layout holds a forwarded request's capacity while the admitting process's own accounting
process is behind, and with workers the accounting stream may reach another worker's, whose
lag the admitting worker cannot see (docs/deploy.md, "Accounting in a process of its own").

A worker that hangs (its event loop blocked, or the process stopped) does not exit: one whose
admin server has not answered `/healthz` for `--worker-liveness-timeout` seconds is killed and
restarted like a crashed one (extproc.service.liveness).

Signals: SIGTERM/SIGINT drain every worker (a second one kills them), SIGHUP reloads them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from extproc.envoy_config import bracketed, split_host_port
from extproc.policy import PolicyError, load_policy
from extproc.service.liveness import LIVENESS_TIMEOUT_S, LivenessWatch, healthz_url
from extproc.types import WORKER_INDEX_ENV

log = logging.getLogger("extproc.workers")
_N = TypeVar("_N", int, float)

WORKER_PORTS = ("shared", "distinct")
RESTART_BACKOFF_MIN_S, RESTART_BACKOFF_MAX_S = 0.5, 30.0
HEALTHY_AFTER_S = 60.0
"""A worker that ran this long is healthy again: its next crash restarts it at once."""
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1


def add_arguments(parser: argparse.ArgumentParser, default_ports: str = "shared") -> None:
    """The worker flags of `extproc serve` (and of `extproc up`, whose Envoy balances best
    over distinct ports: `default_ports="distinct"`)."""
    parser.add_argument(
        "--workers", type=int, default=_env_number("EXTPROC_WORKERS", 1, int), metavar="N",
        help="service processes (default %(default)s; with N > 1 use state.backend redis)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-ports", choices=WORKER_PORTS, default=default_ports,
        help="shared: one gRPC port for all (SO_REUSEPORT); distinct: worker i on port + i",
    )  # fmt: skip
    parser.add_argument(
        "--allow-unshared-workers", action="store_true",
        help="allow N > 1 workers with the memory state store (each enforces every limit)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-liveness-timeout", type=float, metavar="SECONDS",
        default=_env_number("EXTPROC_WORKER_LIVENESS_TIMEOUT", LIVENESS_TIMEOUT_S, float),
        help="kill and restart a worker (under `extproc up`, also a single service process) "
        "whose /healthz has not answered this long (default %(default)s; 0: never)",
    )  # fmt: skip


WORKER_COUNT_ENV = "EXTPROC_WORKER_COUNT"
"""Set for each worker: how many processes of this service share the engines."""


def _env_number(name: str, default: _N, kind: Callable[[str], _N]) -> _N:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise SystemExit(f"{name}={raw!r}: expected {what}") from None


def worker_address(address: str, index: int, ports: str) -> str:
    """The gRPC (or admin) address of worker `index`."""
    if ports == "shared" or index == 0:
        return address
    host, port = split_host_port(address)
    if port == 0:
        return address
    return f"{bracketed(host)}:{port + index}"


def worker_addresses(address: str, workers: int, ports: str) -> list[str]:
    """Every address Envoy's ext_proc cluster should list for these workers."""
    if ports == "shared":
        return [address]
    return [worker_address(address, i, ports) for i in range(workers)]


def check_state(policy_path: str, workers: int, allow_unshared: bool) -> str | None:
    """Why these workers cannot run with this policy, or None."""
    try:
        policy = load_policy(policy_path)
    except PolicyError as error:
        return str(error)
    state = policy.source.state
    if workers > 1 and state.backend == "memory" and not allow_unshared:
        return (
            f"--workers {workers} with state.backend memory: each worker would enforce every "
            f"limit on its own ({workers} x the limits) and could not settle requests whose "
            "accounting stream reaches another worker. Share state through Redis "
            "(state: {backend: redis, url: ...}) or pass --allow-unshared-workers."
        )
    if workers > 1 and state.backend == "redis" and state.replicas < workers:
        log.warning(
            "state.replicas is %d but %d workers run: if Redis fails, each worker's local "
            "share (1/%d of every limit) adds up to more than the limit",
            state.replicas, workers, state.replicas,
        )  # fmt: skip
    return None


def check_accounting(workers: int, accounting_grpc: str) -> str | None:
    """Why `--accounting-grpc` cannot run with these workers, or None."""
    if workers <= 1 or not accounting_grpc.strip():
        return None
    return (
        f"--accounting-grpc with --workers {workers} is not supported: the accounting process "
        "holds a forwarded request's capacity while it is behind, which only the process that "
        "admitted the request can do, and with several workers Envoy sends the accounting "
        "stream to any worker's. Run one worker per host with --accounting-grpc (scale out "
        "with replicas sharing Redis), or --workers without it (accounting on --grpc)."
    )


def check_envoy_events(workers: int, envoy_events: str, ports: str = "shared") -> str | None:
    """Why `--envoy-events` cannot run with these workers, or None. Each worker needs an
    events port of its own (port + i), so that Envoy sends a request's calls and its end to
    the worker that admitted it (extproc.envoy_lua, per worker): `--worker-ports distinct`
    and a port given."""
    if workers <= 1 or not envoy_events.strip():
        return None
    if ports != "distinct":
        return (
            f"--envoy-events with --workers {workers} needs --worker-ports distinct: Envoy "
            "sends a request's counting calls and its end to the worker that admitted it, on "
            "that worker's own gRPC and events ports (port + i), which one shared port cannot "
            "tell apart."
        )
    if split_host_port(envoy_events)[1] == 0:
        return (
            f"--envoy-events {envoy_events} with --workers {workers}: give a port (worker i "
            "listens on it + i, and Envoy's clusters must name each)."
        )
    return None


def reserve_port(address: str) -> tuple[str, socket.socket | None]:
    """A concrete address for `host:0`, held by a bound (not listening) SO_REUSEPORT socket so
    that nobody else takes the port while workers come and go."""
    host, port = split_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        if port == 0:
            raise
        return address, None  # taken without SO_REUSEPORT: the workers will say so
    return f"{bracketed(host)}:{sock.getsockname()[1]}", sock


@dataclass
class Worker:
    index: int
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = RESTART_BACKOFF_MIN_S
    restart_at: float | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command, env=self.env, start_new_session=True, preexec_fn=_die_with_parent
        )
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)


def _die_with_parent() -> None:
    """Workers get SIGTERM if the supervisor dies (Linux); elsewhere nothing happens."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Supervisor:
    commands: list[list[str]]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    stop_timeout_s: float = 40.0
    workers: list[Worker] = field(default_factory=list)
    stopping: bool = False
    forced: bool = False
    health_urls: list[str | None] = field(default_factory=list)
    """Each worker's `/healthz` (None: not watched)."""
    liveness_timeout_s: float = 0.0
    """0: a hung worker is left alone."""
    watches: dict[int, LivenessWatch] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workers = [
            Worker(
                i,
                command,
                {
                    **self.env,
                    WORKER_INDEX_ENV: str(i),
                    WORKER_COUNT_ENV: str(len(self.commands)),
                },
            )
            for i, command in enumerate(self.commands)
        ]

    def on_stop_signal(self, _signum: int, _frame: object) -> None:
        if self.stopping:
            self.forced = True
            for worker in self.workers:
                worker.signal(signal.SIGKILL)
            return
        self.stopping = True
        for worker in self.workers:
            worker.signal(signal.SIGTERM)

    def on_hup(self, _signum: int, _frame: object) -> None:
        for worker in self.workers:
            worker.signal(signal.SIGHUP)

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.on_stop_signal)
        signal.signal(signal.SIGINT, self.on_stop_signal)
        signal.signal(signal.SIGHUP, self.on_hup)

    def watch(self) -> None:
        """Start watching each worker's `/healthz` (when a timeout and its URL are known)."""
        if self.liveness_timeout_s <= 0:
            return
        for worker, url in zip(self.workers, self.health_urls, strict=False):
            if url is not None:
                self.watches[worker.index] = LivenessWatch(url, self.liveness_timeout_s)

    def step(self, now: float) -> None:
        """Notice dead workers and restart those whose backoff has passed; kill hung ones."""
        for worker in self.workers:
            watch = self.watches.get(worker.index)
            if worker.restart_at is not None:
                if now >= worker.restart_at and not self.stopping:
                    worker.restarts += 1
                    worker.start()
                    if watch is not None:
                        watch.restarted(now)
                    log.warning("worker %d restarted (pid %s)", worker.index, worker.pid)
                continue
            code = worker.exited()
            if code is None and not self.stopping and watch is not None:
                silent = watch.overdue(now)
                if silent is not None:
                    log.error(
                        "worker %d (pid %s) has not answered %s for %.1fs: killing it",
                        worker.index, worker.pid, watch.url, silent,
                    )  # fmt: skip
                    worker.signal(signal.SIGKILL)
                    watch.restarted(now)  # not overdue again while it dies
            if code is None or self.stopping:
                continue
            if now - worker.started_at >= HEALTHY_AFTER_S:
                worker.backoff_s = RESTART_BACKOFF_MIN_S
            worker.restart_at = now + worker.backoff_s
            log.error(
                "worker %d (pid %s) exited with %s; restarting in %.1fs",
                worker.index, worker.pid, code, worker.backoff_s,
            )  # fmt: skip
            worker.backoff_s = min(worker.backoff_s * 2, RESTART_BACKOFF_MAX_S)

    def run(self) -> int:
        for worker in self.workers:
            worker.start()
        self.watch()
        log.info(
            "supervising %d workers", len(self.workers),
            extra={"fields": {"pids": [w.pid for w in self.workers]}},
        )  # fmt: skip
        while not self.stopping:
            self.step(time.monotonic())
            time.sleep(_POLL_S)
        deadline = time.monotonic() + self.stop_timeout_s
        while any(w.exited() is None for w in self.workers):
            if time.monotonic() > deadline:
                log.error("workers did not stop in %.0fs; killing them", self.stop_timeout_s)
                for worker in self.workers:
                    worker.signal(signal.SIGKILL)
                self.forced = True
                break
            time.sleep(_POLL_S)
        for watch in self.watches.values():
            watch.stop()
        for worker in self.workers:
            if worker.process is not None:
                worker.process.wait()
        # A worker still starting when the stop came dies of the SIGTERM itself: that is a stop.
        clean = (0, -signal.SIGTERM)
        codes = [w.exited() for w in self.workers]
        return 0 if not self.forced and all(code in clean for code in codes) else 1


def worker_commands(args: argparse.Namespace, grpc_address: str) -> list[list[str]]:
    """One `python -m extproc.service.main` command line per worker."""
    passthrough: list[str] = []
    for flag, name in (
        ("--drain-grace", "drain_grace"), ("--log-format", "log_format"),
        ("--reload-interval", "reload_interval"),
    ):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None:
            passthrough += [flag, str(value)]
    for flag, name in (
        ("--admin-remote-reload", "admin_remote_reload"), ("--wait-for-policy", "wait_for_policy"),
    ):  # fmt: skip
        if getattr(args, name, False):
            passthrough.append(flag)
    ports = getattr(args, "worker_ports", "shared")
    events = (getattr(args, "envoy_events", "") or "").strip()
    python = [sys.executable, "-m", "extproc.service.main", "--policy", str(Path(args.policy))]
    return [
        [
            *python,
            *("--grpc", worker_address(grpc_address, i, ports)),
            *("--admin", worker_address(args.admin, i, "distinct")),
            *(("--envoy-events", worker_address(events, i, "distinct")) if events else ()),
            *passthrough,
        ]
        for i in range(args.workers)
    ]


def run_workers(args: argparse.Namespace) -> int:
    """Entry point of `extproc serve --workers N` (N >= 2)."""
    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    problem = check_accounting(
        args.workers, getattr(args, "accounting_grpc", "") or ""
    ) or check_envoy_events(
        args.workers,
        getattr(args, "envoy_events", "") or "",
        getattr(args, "worker_ports", "shared"),
    )
    if problem is None:
        problem = check_state(args.policy, args.workers, args.allow_unshared_workers)
    if problem is not None:
        print(f"extproc serve: {problem}", file=sys.stderr)
        return 2
    held: socket.socket | None = None
    address = args.grpc
    if getattr(args, "worker_ports", "shared") == "shared":
        address, held = reserve_port(args.grpc)
    supervisor = Supervisor(
        worker_commands(args, address),
        stop_timeout_s=float(getattr(args, "drain_grace", None) or 30.0) + 10.0,
        health_urls=[
            healthz_url(worker_address(args.admin, i, "distinct")) for i in range(args.workers)
        ],
        liveness_timeout_s=float(getattr(args, "worker_liveness_timeout", LIVENESS_TIMEOUT_S)),
    )
    supervisor.install_signal_handlers()
    print(
        f"extproc serve: {args.workers} workers on {address} "
        f"({getattr(args, 'worker_ports', 'shared')} port)",
        file=sys.stderr,
        flush=True,
    )
    try:
        return supervisor.run()
    finally:
        if held is not None:
            held.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m extproc.service.workers`: the supervisor with the serve flags it passes on."""
    from extproc.defaults import default_policy_path

    parser = argparse.ArgumentParser(prog="extproc serve --workers N")
    parser.add_argument("--policy", default=default_policy_path())
    parser.add_argument("--grpc", default="127.0.0.1:50051")
    parser.add_argument("--admin", default="127.0.0.1:9090")
    parser.add_argument("--drain-grace", type=float, default=None)
    parser.add_argument("--log-format", default=None)
    parser.add_argument("--reload-interval", type=float, default=None)
    parser.add_argument(
        "--accounting-grpc", default=os.environ.get("EXTPROC_ACCOUNTING_GRPC", ""),
        metavar="ADDRESS", help="refused with --workers N > 1 (see the module doc)",
    )  # fmt: skip
    parser.add_argument(
        "--envoy-events", default=os.environ.get("EXTPROC_ENVOY_EVENTS", ""), metavar="ADDRESS",
        help="Envoy counts: worker i's events listener on this port + i (--worker-ports distinct)",
    )  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_workers(args)


if __name__ == "__main__":
    sys.exit(main())
