"""The real stack with real vLLM pools: Envoy binary, ext_proc service, one vLLM server per pool.

Like tests/dataplane/harness.py, but the emulated engines of `extproc up`'s stack are replaced by
:func:`gateway_lab.vllm_cpu.stack.vllm_children`. Envoy and the service run from this interpreter;
the engines from ``$EXTPROC_VLLM_PYTHON`` or this interpreter.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from extproc.policy import Policy
from gateway_lab.processes import Stack
from gateway_lab.up import StackConfig, build_stack, wait_ready
from gateway_lab.vllm_cpu.launcher import vllm_python
from gateway_lab.vllm_cpu.model_builder import default_cache_dir
from gateway_lab.vllm_cpu.stack import (
    VllmChild,
    build_model,
    engine_specs,
    vllm_children,
    wait_engines_ready,
)
from tests.dataplane.harness import ACTIVE_STACKS, loopback_config

ENGINE_READY_TIMEOUT_S = 300.0


def _progress(message: str) -> None:
    print(f"[vllm stack] {message}", file=sys.stderr, flush=True)


@dataclass
class VllmGateway:
    base_url: str
    admin_url: str
    policy: Policy
    stack: Stack
    config: StackConfig
    engines: dict[str, str]
    """pool -> engine base URL (one engine per pool here)."""
    startup_s: dict[str, float] = field(default_factory=dict)

    def envoy_access_log(self) -> list[dict[str, object]]:
        """Envoy's JSON access-log lines (stdout of the envoy child), oldest first."""
        envoy = next(c for c in self.stack.children if c.name == "envoy")
        entries = []
        for line in envoy.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"upstream"' in line:
                with contextlib.suppress(ValueError):
                    entries.append(json.loads(line))
        return entries


@contextlib.contextmanager
def running_vllm_gateway(
    workdir: Path, make_policy: Callable[[str, str], str], count_in_envoy: bool = False
) -> Iterator[VllmGateway]:
    """`make_policy(short_endpoint, long_endpoint)` returns the policy text to run with;
    `count_in_envoy`: Envoy counts the responses (`extproc up`'s default layout) instead of
    the accounting filter in the service's process."""
    policy, config = loopback_config(workdir, make_policy, count_in_envoy=count_in_envoy)
    python = vllm_python()
    model = build_model(python, default_cache_dir(), progress=_progress)
    emulated = build_stack(config, policy)
    engines = vllm_children(policy, workdir, python, model=model, progress=_progress)
    # The vLLM engines replace the emulated ones; they start first (they take longest).
    stack = Stack([*engines, *(c for c in emulated.children if not c.name.startswith("engine "))])
    ACTIVE_STACKS.append(stack)
    started = time.monotonic()
    try:
        for child in stack.children:
            _progress(f"starting {child.name} (log: {child.log_path})")
            child.start()
        startup = wait_engines_ready(
            stack, timeout=ENGINE_READY_TIMEOUT_S, progress=_progress, progress_every=10.0
        )
        wait_ready(config, policy, stack)
        _progress(f"stack ready in {time.monotonic() - started:.1f} s")
        yield VllmGateway(
            base_url=f"http://{config.listen}",
            admin_url=f"http://{config.admin}",
            policy=policy,
            stack=stack,
            config=config,
            engines={spec.pool: spec.base_url for spec in engine_specs(policy)},
            startup_s=startup,
        )
    finally:
        stopping = time.monotonic()
        stack.stop()
        ACTIVE_STACKS.remove(stack)
        leftovers = [c.name for c in stack.children if isinstance(c, VllmChild) and c.alive()]
        _progress(f"stopped in {time.monotonic() - stopping:.1f} s; still alive: {leftovers}")
