"""Start the real stack (Envoy binary, ext_proc service, emulated engines) on loopback ports."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extproc.policy import Policy, hash_key, load_policy
from gateway_lab.bench.trips import set_one_round_trip
from gateway_lab.processes import Stack
from gateway_lab.up import StackConfig, build_stack, wait_ready
from tests.conftest import TEST_KEYS, free_port

ACTIVE_STACKS: list[Stack] = []


def standard_policy(
    short: str, long_: str, gateway: str, tenants: Sequence[str] = ("globex",)
) -> str:
    """A short and a long pool, `tenants` (of TEST_KEYS) in one standard tier, and the
    `gateway:` section's flow mapping `gateway` (e.g. `{message_timeout: 500ms}`)."""
    lines = "".join(
        f'  {name}: {{tier: standard, api_keys: ["{hash_key(TEST_KEYS[name])}"]}}\n'
        for name in tenants
    )
    return f"""\
version: 1
tiers: [standard]
tenants:
{lines}pools:
  short: {{max_total_tokens: 2048, max_inflight: 64, max_inflight_tokens: 400000,
          endpoints: ["{short}"]}}
  long: {{max_total_tokens: 16384, max_inflight: 8, max_inflight_tokens: 600000,
         endpoints: ["{long_}"]}}
gateway: {gateway}
"""


@dataclass
class RunningGateway:
    base_url: str
    admin_url: str
    policy: Policy
    stack: Stack
    config: StackConfig
    layout: str = "two-trips"
    """Which of LAYOUTS the admission filter runs in (set by the fixtures that choose one)."""

    def log_of(self, name: str) -> str:
        child = next(c for c in self.stack.children if c.name == name)
        return child.log_path.read_text(errors="replace")


def loopback_config(
    workdir: Path,
    make_policy: Callable[[str, str], str],
    profile: str = "fast",
    accounting_process: bool = False,
    count_in_envoy: bool = False,
) -> tuple[Policy, StackConfig]:
    """The policy (written to `workdir`) and a stack configuration on free loopback ports;
    `accounting_process`: the service accounts in a child process (`--accounting-grpc`);
    `count_in_envoy`: Envoy counts and tells the service (`--envoy-events`)."""
    short, long_ = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    policy_path = workdir / "policy.yaml"
    policy_path.write_text(make_policy(short, long_))
    policy = load_policy(policy_path)
    config = StackConfig(
        policy_path=str(policy_path),
        workdir=workdir,
        listen=f"127.0.0.1:{free_port()}",
        grpc=f"127.0.0.1:{free_port()}",
        admin=f"127.0.0.1:{free_port()}",
        envoy_admin=f"127.0.0.1:{free_port()}",
        profile=profile,
        accounting=f"127.0.0.1:{free_port()}" if accounting_process else None,
        envoy_events=f"127.0.0.1:{free_port()}" if count_in_envoy else None,
    )
    return policy, config


def one_round_trip(bootstrap: dict[str, Any], _: StackConfig) -> dict[str, Any]:
    """An `envoy_bootstrap` edit: the admission filter streams the body without waiting for
    the headers reply (`envoy render --one-round-trip`)."""
    return set_one_round_trip(bootstrap)


LAYOUTS: dict[str, Callable[[dict[str, Any], StackConfig], dict[str, Any]] | None] = {
    "two-trips": None,
    "one-trip": one_round_trip,
}
"""The admission filter's two ways of taking the body, as `running_gateway` edits."""


@contextlib.contextmanager
def running_gateway(
    workdir: Path,
    make_policy: Callable[[str, str], str],
    profile: str = "fast",
    accounting_process: bool = False,
    count_in_envoy: bool = False,
    envoy_bootstrap: Callable[[dict[str, Any], StackConfig], dict[str, Any]] | None = None,
) -> Iterator[RunningGateway]:
    """`make_policy(short_endpoint, long_endpoint)` returns the policy text to run with;
    `envoy_bootstrap(rendered, config)` changes Envoy's rendered bootstrap before it starts."""
    policy, config = loopback_config(
        workdir, make_policy, profile, accounting_process, count_in_envoy
    )
    stack = build_stack(config, policy)
    if envoy_bootstrap is not None:
        path = workdir / "envoy.json"
        path.write_text(json.dumps(envoy_bootstrap(json.loads(path.read_text()), config)))
    with started(config, policy, stack) as running:
        yield running


@contextlib.contextmanager
def started(config: StackConfig, policy: Policy, stack: Stack) -> Iterator[RunningGateway]:
    """Start a built stack, wait until it is ready; stop it on exit, also on failure."""
    ACTIVE_STACKS.append(stack)
    try:
        for child in stack.children:
            child.start()
        wait_ready(config, policy, stack)
        yield RunningGateway(
            base_url=f"http://{config.listen}",
            admin_url=f"http://{config.admin}",
            policy=policy,
            stack=stack,
            config=config,
        )
    finally:
        stack.stop()
        ACTIVE_STACKS.remove(stack)


@contextlib.contextmanager
def running_in_layout(
    layout: str, workdir: Path, make_policy: Callable[[str, str], str], profile: str = "fast"
) -> Iterator[RunningGateway]:
    """`running_gateway` with the admission filter taking the body as LAYOUTS[layout] says
    (the fixtures parametrized over both layouts use it)."""
    edit = LAYOUTS[layout]
    with running_gateway(workdir, make_policy, profile, envoy_bootstrap=edit) as running:
        running.layout = layout
        yield running
