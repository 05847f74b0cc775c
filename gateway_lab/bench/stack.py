"""Benchmark stacks on loopback: emulated engines, an ext_proc server (ours, the do-nothing floor,
or none) and the real Envoy, started as separate processes so each one's CPU can be read."""

from __future__ import annotations

import contextlib
import functools
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from extproc.envoy_config import RenderOptions, render_bootstrap, split_host_port
from extproc.policy import Policy, load_policy
from gateway_lab.processes import Child, Stack, envoy_binary, http_ok, wait_until

ARMS = ("straight", "noop", "extproc")
_READY_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tcp_open(address: str) -> bool:
    host, port = split_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class BenchStack:
    arm: str
    base_url: str
    admin_url: str | None
    policy: Policy
    stack: Stack

    def pid_of(self, name: str) -> int | None:
        for child in self.stack.children:
            if child.name == name and child.process is not None:
                return child.process.pid
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (clock ticks of 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


@dataclass
class FrontChildren:
    """What sits in front of the engines for one arm: the ext_proc server (if any) and Envoy,
    not started yet, with the checks that tell they are ready."""

    children: list[Child]
    checks: list[tuple[Callable[[], bool], str]]
    base_url: str
    admin_url: str | None


def front_children(
    workdir: Path,
    policy_path: Path,
    policy: Policy,
    arm: str,
    extproc_args: tuple[str, ...] = (),
) -> FrontChildren:
    """Envoy on fresh loopback ports, straight to the policy's endpoints (`straight`) or
    through `extproc serve` (`extproc`) or the do-nothing floor (`noop`)."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}")
    listen, grpc_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    admin, envoy_admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    python = sys.executable
    children: list[Child] = []
    checks: list[tuple[Callable[[], bool], str]] = []
    if arm == "extproc":
        children.append(
            Child(
                name="extproc",
                command=[
                    python, "-m", "extproc", "--log-level", "WARNING", "serve",
                    "--policy", str(policy_path), "--grpc", grpc_address, "--admin", admin,
                    *extproc_args,
                ],
                log_path=workdir / "extproc.log",
            )
        )  # fmt: skip
        checks.append((functools.partial(http_ok, f"http://{admin}/readyz"), "extproc"))
    elif arm == "noop":
        children.append(
            Child(
                name="extproc",
                command=[python, "-m", "gateway_lab.bench.noop", "--grpc", grpc_address],
                log_path=workdir / "noop.log",
            )
        )
    if arm != "straight":
        checks.append((functools.partial(tcp_open, grpc_address), "ext_proc gRPC"))
    envoy_config = workdir / "envoy.json"
    options = RenderOptions(
        listen=listen,
        extproc=grpc_address,
        admin=envoy_admin,
        extproc_filters=arm != "straight",
        access_log=False,
    )
    envoy_config.write_text(render_bootstrap(policy, options))
    children.append(
        Child(
            name="envoy",
            command=[
                envoy_binary(), "-c", str(envoy_config), "--log-level", "error",
                "--use-dynamic-base-id", "--concurrency", "1",
            ],
            log_path=workdir / "envoy.log",
        )
    )  # fmt: skip
    checks.append((functools.partial(http_ok, f"http://{envoy_admin}/ready"), "envoy"))
    return FrontChildren(
        children, checks, f"http://{listen}", f"http://{admin}" if arm == "extproc" else None
    )


def engine_children(
    workdir: Path, endpoints: dict[str, list[str]], profile: str, engine_args: tuple[str, ...]
) -> tuple[list[Child], list[tuple[Callable[[], bool], str]]]:
    """One emulated engine per endpoint, by pool, not started yet."""
    children: list[Child] = []
    checks: list[tuple[Callable[[], bool], str]] = []
    for pool, addresses in endpoints.items():
        for index, endpoint in enumerate(addresses):
            host, port = split_host_port(endpoint)
            children.append(
                Child(
                    name=f"engine {pool}#{index}",
                    command=[
                        sys.executable, "-m", "extproc", "engine", "--host", host,
                        "--port", str(port), "--profile", profile,
                        "--engine-id", f"{pool}-{index}", "--accept-any-model", *engine_args,
                    ],
                    log_path=workdir / f"engine-{pool}-{index}.log",
                )
            )  # fmt: skip
            checks.append((functools.partial(http_ok, f"http://{endpoint}/health"), endpoint))
    return children, checks


def start_all(stack: Stack, checks: list[tuple[Callable[[], bool], str]]) -> None:
    for child in stack.children:
        child.start()
    for check, what in checks:
        wait_until(check, stack, what, _READY_S)


@contextlib.contextmanager
def bench_stack(
    workdir: Path,
    make_policy: Callable[[str, str], str],
    arm: str = "extproc",
    profile: str = "a100-llama3-8b",
    engine_args: tuple[str, ...] = (),
    extproc_args: tuple[str, ...] = (),
) -> Iterator[BenchStack]:
    """`make_policy(short_endpoint, long_endpoint)` gives the policy text; `arm` picks what
    sits between Envoy and the engines."""
    workdir.mkdir(parents=True, exist_ok=True)
    short, long_ = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    policy_path = workdir / "policy.yaml"
    policy_path.write_text(make_policy(short, long_))
    policy = load_policy(policy_path)
    endpoints = {name: list(spec.endpoints) for name, spec in policy.pools.items()}
    engines, checks = engine_children(workdir, endpoints, profile, engine_args)
    front = front_children(workdir, policy_path, policy, arm, extproc_args)
    stack = Stack()
    stack.children.extend([*engines, *front.children])
    try:
        start_all(stack, [*checks, *front.checks])
        yield BenchStack(
            arm=arm,
            base_url=front.base_url,
            admin_url=front.admin_url,
            policy=policy,
            stack=stack,
        )
    finally:
        stack.stop()
