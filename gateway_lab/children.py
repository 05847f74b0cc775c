"""The children of a local stack, not started yet: emulated engines, `extproc serve`, Envoy.

`extproc up` and the benchmark stacks build their processes from these, so an engine, the
service and Envoy are started the same way everywhere; only the flags each stack adds differ.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.envoy_config import RenderOptions, render_bootstrap, split_host_port
from extproc.policy import Policy
from gateway_lab.processes import STOP_MIDDLE, Child, envoy_binary


def engine_child(
    workdir: Path,
    pool: str,
    index: int,
    endpoint: str,
    profile: str,
    engine_args: Sequence[str] = (),
) -> Child:
    """`extproc engine` serving `endpoint` as engine `index` of `pool`."""
    host, port = split_host_port(endpoint)
    return Child(
        name=f"engine {pool}#{index}",
        command=[
            sys.executable, "-m", "extproc", "engine", "--host", host, "--port", str(port),
            "--profile", profile, "--engine-id", f"{pool}-{index}", "--accept-any-model",
            *engine_args,
        ],
        log_path=workdir / f"engine-{pool}-{index}.log",
    )  # fmt: skip


def extproc_child(
    workdir: Path,
    policy_path: str,
    grpc: str,
    admin: str,
    serve_args: Sequence[str] = (),
    *,
    log_level: str | None = None,
    stop_rank: int = STOP_MIDDLE,
    stop_timeout: float = 10.0,
) -> Child:
    """`extproc serve` with the policy at `policy_path` (`serve_args` after the addresses)."""
    level = ["--log-level", log_level] if log_level is not None else []
    return Child(
        name="extproc",
        command=[
            sys.executable, "-m", "extproc", *level, "serve", "--policy", policy_path,
            "--grpc", grpc, "--admin", admin, *serve_args,
        ],
        log_path=workdir / "extproc.log",
        stop_rank=stop_rank,
        stop_timeout=stop_timeout,
    )  # fmt: skip


def envoy_child(
    workdir: Path,
    policy: Policy,
    options: RenderOptions,
    *,
    log_level: str,
    stop_rank: int = STOP_MIDDLE,
) -> Child:
    """Envoy (one worker thread) with the bootstrap rendered from `policy` into workdir."""
    config = workdir / "envoy.json"
    config.write_text(render_bootstrap(policy, options))
    return Child(
        name="envoy",
        command=[
            envoy_binary(), "-c", str(config), "--log-level", log_level,
            "--use-dynamic-base-id", "--concurrency", "1",
        ],
        log_path=workdir / "envoy.log",
        stop_rank=stop_rank,
    )  # fmt: skip
