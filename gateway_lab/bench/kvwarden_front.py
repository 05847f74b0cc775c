"""kvwarden 0.1.6 as a peer arm: its router fronting an engine that already runs
(`KVWARDEN_DEV_SKIP_ENGINE_LAUNCH=1`), tenants from `X-Tenant-ID`, a per-tenant token bucket.
It lives in its own environment (scripts/setup-kvwarden.sh): `--kvwarden-venv`."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from extproc.envoy_config import split_host_port
from gateway_lab.bench.stack import Gateway, free_port, running
from gateway_lab.processes import Child, Stack, http_ok

DEFAULT_VENV = Path(".venv-kvwarden")


@dataclass(frozen=True)
class Bucket:
    """kvwarden's per-tenant `tenant_defaults`: requests/min refill and burst."""

    rate_limit_rpm: int = 600
    rate_limit_burst: int = 10


def kvwarden_binary(venv: Path) -> Path:
    binary = venv / "bin" / "kvwarden"
    if not binary.exists():
        raise FileNotFoundError(
            f"{binary} not found: run scripts/setup-kvwarden.sh (or pass --kvwarden-venv)"
        )
    return binary


def config_text(port: int, engine: str, model: str, bucket: Bucket) -> str:
    _host, engine_port = split_host_port(engine)
    return f"""\
host: 127.0.0.1
port: {port}
models:
  - {{model_id: {model}, engine: vllm, port: {engine_port}}}
tenant_defaults:
  rate_limit_rpm: {bucket.rate_limit_rpm}
  rate_limit_burst: {bucket.rate_limit_burst}
log_level: WARNING
"""


@contextlib.contextmanager
def kvwarden_front(
    workdir: Path, venv: Path, engine: str, model: str, bucket: Bucket = Bucket()
) -> Iterator[Gateway]:
    """kvwarden serving on a fresh loopback port in front of `engine` (host:port)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = workdir / "kvwarden.yaml"
    config.write_text(config_text(port, engine, model, bucket))
    env = {
        **os.environ,
        "KVWARDEN_DEV_SKIP_ENGINE_LAUNCH": "1",
        "KVWARDEN_TELEMETRY": "0",
        "KVWARDEN_TELEMETRY_URL": "",
    }
    child = Child(
        name="kvwarden",
        command=[str(kvwarden_binary(venv)), "serve", "--config", str(config), "--no-interactive"],
        log_path=workdir / "kvwarden.log",
        env=env,
    )
    stack = Stack(children=[child])
    base = f"http://127.0.0.1:{port}"
    check = functools.partial(http_ok, f"{base}/health")
    with running(stack, [(check, "kvwarden")]):
        yield Gateway(arm="kvwarden", base_url=base, admin_url=None, stack=stack)
