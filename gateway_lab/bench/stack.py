"""Benchmark stacks on loopback, started as separate processes so each one's CPU can be read:
emulated engines (`engine_set`), and in front of them the real Envoy with an ext_proc server
(ours, the do-nothing floor, or none: `gateway_stack`). `bench_stack` is both at once."""

from __future__ import annotations

import contextlib
import functools
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from extproc.envoy_config import RenderOptions, split_host_port
from extproc.policy import Policy, policy_from_text
from extproc.service.workers import worker_addresses
from gateway_lab import up
from gateway_lab.children import engine_child, envoy_child, extproc_child
from gateway_lab.processes import Child, Stack, http_ok, wait_until

ARMS = ("straight", "noop", "extproc")
PROFILE = "a100-llama3-8b"
_READY_S = 60.0

Check = tuple[Callable[[], bool], str]
T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports free now (workers on distinct ports:
    worker i on the first + i). One port is `free_port`'s, as every other port here (a
    port taken before its server binds it makes `running_on_fresh_ports` start again)."""
    base = free_port()
    return base if count == 1 else up.free_ports("127.0.0.1", base, count)


def tcp_open(address: str) -> bool:
    host, port = split_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (clock ticks of 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


@contextlib.contextmanager
def running(stack: Stack, checks: Sequence[Check]) -> Iterator[Stack]:
    """Start every child, wait for every check; stop them all on exit (or a failed start)."""
    try:
        _start(stack, checks)
        yield stack
    finally:
        stack.stop()


def _start(stack: Stack, checks: Sequence[Check]) -> None:
    for child in stack.children:
        child.start()
    for check, what in checks:
        wait_until(check, stack, what, _READY_S)


PORT_ATTEMPTS = 3
"""Starts of one stack, each on fresh ports, while a child fails because a port is taken."""


def port_was_taken(stack: Stack) -> bool:
    """A child exited because an address it was given was in use: `free_port` found the port
    free, and something else (an ephemeral port of a client connection) took it before the
    child bound it. Envoy, `extproc serve` and the engines all log this errno's text."""
    dead = stack.dead()
    return dead is not None and "address already in use" in dead.log_tail(60).lower()


@contextlib.contextmanager
def running_on_fresh_ports(
    build: Callable[[], tuple[Stack, Sequence[Check], T]], attempts: int = PORT_ATTEMPTS
) -> Iterator[T]:
    """`build()` picks ports and makes the children; start them and wait for the checks,
    and if a child exits because its port was taken meanwhile, stop the stack and build it
    again on fresh ports, up to `attempts` starts (any other failure is raised at once).
    Yields what the successful `build` returned; stops the stack on exit."""
    for attempt in range(1, attempts + 1):
        stack, checks, built = build()
        try:
            _start(stack, checks)
        except RuntimeError:
            taken = port_was_taken(stack)
            stack.stop()
            if taken and attempt < attempts:
                print(
                    f"a port was taken before its server bound it; starting again on fresh "
                    f"ports ({attempt}/{attempts})",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            raise
        try:
            yield built
        finally:
            stack.stop()
        return


@dataclass
class EngineSet:
    """Emulated engines, one per endpoint, by pool."""

    endpoints: dict[str, list[str]]

    def all(self) -> list[str]:
        return [e for endpoints in self.endpoints.values() for e in endpoints]


@contextlib.contextmanager
def engine_set(
    workdir: Path,
    pools: Mapping[str, int],
    profile: str = PROFILE,
    engine_args: Sequence[str] = (),
) -> Iterator[EngineSet]:
    """Start `pools[name]` engines for each pool on fresh loopback ports; stop them on exit."""
    workdir.mkdir(parents=True, exist_ok=True)

    def build() -> tuple[Stack, list[Check], EngineSet]:
        endpoints = {
            name: [f"127.0.0.1:{free_port()}" for _ in range(count)]
            for name, count in pools.items()
        }
        stack = Stack()
        checks: list[Check] = []
        for pool, addresses in endpoints.items():
            for index, endpoint in enumerate(addresses):
                stack.children.append(
                    engine_child(workdir, pool, index, endpoint, profile, engine_args)
                )
                checks.append((functools.partial(http_ok, f"http://{endpoint}/health"), endpoint))
        return stack, checks, EngineSet(endpoints)

    with running_on_fresh_ports(build) as engines:
        yield engines


@dataclass
class Gateway:
    """One arm's Envoy (and ext_proc server): where to send requests."""

    arm: str
    base_url: str
    admin_url: str | None
    stack: Stack
    extproc_grpc: str | None = None
    """The ext_proc server's gRPC address (None when Envoy goes straight, or not Envoy)."""

    @property
    def url(self) -> str:
        return self.base_url + "/v1/chat/completions"

    def pid_of(self, name: str) -> int | None:
        for child in self.stack.children:
            if child.name == name and child.process is not None:
                return child.process.pid
        return None


@contextlib.contextmanager
def gateway_stack(
    workdir: Path,
    policy_text: str,
    arm: str,
    extproc_args: Sequence[str] = (),
    bootstrap_edit: Callable[[str], str] | None = None,
    accounting_process: bool = False,
    noop_args: Sequence[str] = (),
    extproc_env: Mapping[str, str] | None = None,
    count_in_envoy: bool = False,
    workers: int = 1,
    cpu_slice_us: int = 0,
) -> Iterator[Gateway]:
    """Envoy on fresh loopback ports, straight to the policy's endpoints (`straight`) or
    through `extproc serve` (`extproc`, in an environment of `extproc_env` if given) or the
    do-nothing floor (`noop`, with `noop_args`: gateway_lab.bench.noop). `bootstrap_edit`
    rewrites Envoy's rendered bootstrap (JSON text, access log on) before it starts.
    `accounting_process`: the service accounts in a child process on a port of its own
    (`serve --accounting-grpc`, Envoy's accounting cluster). `count_in_envoy`: Envoy counts
    and tells the service (`serve --envoy-events`, extproc.envoy_lua) instead. `workers`:
    `serve --workers N` on distinct ports, each worker's own limits (`--allow-unshared-workers`:
    the benchmarks' limits never bind), Envoy spreading requests over them. `cpu_slice_us`:
    the service and Envoy ask for that CPU slice (gateway_lab.bench.cpu_slice); 0: the kernel's."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}")
    workdir.mkdir(parents=True, exist_ok=True)
    policy_path = workdir / "policy.yaml"
    policy_path.write_text(policy_text)
    policy = policy_from_text(policy_text, str(policy_path))

    def build() -> tuple[Stack, list[Check], Gateway]:
        return _gateway_children(
            workdir, policy, str(policy_path), arm, extproc_args, bootstrap_edit,
            accounting_process, noop_args, extproc_env, count_in_envoy, workers, cpu_slice_us,
        )  # fmt: skip

    with running_on_fresh_ports(build) as gateway:
        yield gateway


def _gateway_children(
    workdir: Path,
    policy: Policy,
    policy_path: str,
    arm: str,
    extproc_args: Sequence[str],
    bootstrap_edit: Callable[[str], str] | None,
    accounting_process: bool,
    noop_args: Sequence[str],
    extproc_env: Mapping[str, str] | None,
    count_in_envoy: bool = False,
    workers: int = 1,
    cpu_slice_us: int = 0,
) -> tuple[Stack, list[Check], Gateway]:
    """One start's children of `gateway_stack`, on ports picked now."""
    listen, grpc_port = f"127.0.0.1:{free_port()}", free_ports(workers)
    grpc_address, grpc_all = f"127.0.0.1:{grpc_port}", workers_at(grpc_port, workers)
    admin_port, envoy_admin = free_ports(workers), f"127.0.0.1:{free_port()}"
    admin = f"127.0.0.1:{admin_port}"
    stack = Stack()
    checks: list[Check] = []
    accounting = f"127.0.0.1:{free_port()}" if accounting_process and arm == "extproc" else None
    events_port = free_ports(workers) if count_in_envoy and arm == "extproc" else None
    events = None if events_port is None else f"127.0.0.1:{events_port}"
    if events is not None:
        accounting = None
    if arm == "extproc":
        serve_args = [
            *extproc_args,
            *(["--accounting-grpc", accounting] if accounting else []),
            *(["--envoy-events", events] if events else []),
            *(_workers_args(workers) if workers > 1 else []),
        ]
        child = extproc_child(
            workdir, policy_path, grpc_address, admin, serve_args, log_level="WARNING"
        )
        child.env = None if extproc_env is None else dict(extproc_env)
        child.command = with_cpu_slice(cpu_slice_us, child.command)
        stack.children.append(child)
        checks += [
            (functools.partial(http_ok, f"http://{address}/readyz"), "extproc")
            for address in worker_addresses(admin, workers, "distinct")
        ]
    elif arm == "noop":
        stack.children.append(
            Child(
                name="extproc",
                command=[
                    sys.executable,
                    "-m",
                    "gateway_lab.bench.noop",
                    "--grpc",
                    grpc_address,
                    *noop_args,
                ],
                log_path=workdir / "noop.log",
            )
        )
    if arm != "straight":
        checks.append((functools.partial(tcp_open, grpc_address), "ext_proc gRPC"))
    options = RenderOptions(
        listen=listen,
        extproc=grpc_all if arm == "extproc" else grpc_address,
        accounting=accounting,
        admin=envoy_admin,
        extproc_filters=arm != "straight",
        access_log=bootstrap_edit is not None,
        envoy_events=None if events_port is None else workers_at(events_port, workers),
    )
    envoy = envoy_child(workdir, policy, options, log_level="error")
    envoy.command = with_cpu_slice(cpu_slice_us, envoy.command)
    stack.children.append(envoy)
    if bootstrap_edit is not None:
        bootstrap = workdir / "envoy.json"
        bootstrap.write_text(bootstrap_edit(bootstrap.read_text()))
    checks.append((functools.partial(http_ok, f"http://{envoy_admin}/ready"), "envoy"))
    gateway = Gateway(
        arm=arm,
        base_url=f"http://{listen}",
        admin_url=f"http://{admin}" if arm == "extproc" else None,
        stack=stack,
        extproc_grpc=None if arm == "straight" else grpc_address,
    )
    return stack, checks, gateway


def with_cpu_slice(microseconds: int, command: list[str]) -> list[str]:
    """`command` started on a `microseconds` CPU slice (gateway_lab.bench.cpu_slice); 0: as
    it is."""
    if not microseconds:
        return command
    return [sys.executable, "-m", "gateway_lab.bench.cpu_slice", str(microseconds), "--", *command]


def workers_at(port: int, count: int) -> str:
    """The loopback addresses of `count` workers from `port` on, as RenderOptions lists them."""
    return ",".join(worker_addresses(f"127.0.0.1:{port}", count, "distinct"))


def _workers_args(workers: int) -> list[str]:
    return ["--workers", str(workers), "--worker-ports", "distinct", "--allow-unshared-workers"]


@contextlib.contextmanager
def bench_stack(
    workdir: Path,
    make_policy: Callable[[str, str], str],
    arm: str = "extproc",
    profile: str = PROFILE,
    engine_args: tuple[str, ...] = (),
    extproc_args: tuple[str, ...] = (),
    accounting_process: bool = False,
    extproc_env: Mapping[str, str] | None = None,
    count_in_envoy: bool = False,
    workers: int = 1,
) -> Iterator[Gateway]:
    """A `short` and a `long` engine and one arm in front of them:
    `make_policy(short_endpoint, long_endpoint)` gives the policy text; `accounting_process`
    and `extproc_env` as `gateway_stack`'s."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}")
    with engine_set(workdir, {"short": 1, "long": 1}, profile, engine_args) as engines:
        text = make_policy(engines.endpoints["short"][0], engines.endpoints["long"][0])
        with gateway_stack(
            workdir,
            text,
            arm,
            extproc_args,
            accounting_process=accounting_process,
            extproc_env=extproc_env,
            count_in_envoy=count_in_envoy,
            workers=workers,
        ) as gateway:
            yield gateway
