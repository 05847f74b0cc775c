"""Real vLLM engines as children of `extproc up` (and of the vLLM data-plane tests).

One OpenAI-compatible vLLM server per pool endpoint of a policy, serving the tiny offline model
(:mod:`gateway_lab.vllm_cpu.model_builder`):

- a pool that serves only pooling classes (``serves: [embeddings, rerank]``) gets the pooling
  preset (vLLM's pooling runner, the model converted to an embedding model); of the others,
  the pool with the smallest ``max_total_tokens`` gets the short preset (many sequences), every
  other pool the long preset (long context, few sequences);
- each engine's ``--max-model-len`` is the pool's ``max_total_tokens``, capped at the model's
  16,384 positions (requests above the cap get vLLM's own 400), and its KV cache holds at least
  one request of that length;
- engines are pinned to different cores (round robin over the cores this process may use);
- the model is served as ``tiny-llama`` and ``demo`` (the README demo's name) and, like the
  emulated engines under `extproc up`, any other requested name is accepted too;
- each child stops its whole process group (API server, engine core, worker).

Only the standard library and the gateway's own modules are imported: `extproc up` may run from
an interpreter without vLLM and start the engines with another one (``python``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc.endpoints import GENERATIVE_CLASSES
from extproc.envoy_config import split_host_port
from extproc.policy import Policy
from gateway_lab.processes import STOP_MIDDLE, Child, Stack, http_ok
from gateway_lab.up import engine_endpoints
from gateway_lab.vllm_cpu.launcher import (
    DEFAULT_SERVED_MODEL_NAME,
    LONG_POOL,
    POOLING_POOL,
    SHORT_POOL,
    PoolPreset,
    VllmStartError,
    log_tail,
    preset_command,
    vllm_env,
)
from gateway_lab.vllm_cpu.model_builder import (
    DEFAULT_SPEC,
    default_cache_dir,
    is_built,
    model_dir,
)

__all__ = [
    "MODEL_MAX_LEN",
    "READY_TIMEOUT_S",
    "SERVED_MODEL_NAMES",
    "EngineSpec",
    "VllmChild",
    "VllmStartError",
    "build_model",
    "engine_specs",
    "readiness_urls",
    "vllm_children",
    "wait_engines_ready",
]

SERVED_MODEL_NAMES: tuple[str, ...] = (DEFAULT_SERVED_MODEL_NAME, "demo")
"""Names clients may send as ``model``; responses carry the first one."""
MODEL_MAX_LEN = DEFAULT_SPEC.max_position_embeddings
KV_BLOCK_TOKENS = 128  # vLLM's CPU backend block size
READY_TIMEOUT_S = 300.0
"""Two engines on two shared cores start in 40-60 s; a cold machine can take a few minutes."""
STOP_TIMEOUT_S = 30.0
BUILD_TIMEOUT_S = 600.0
_PROGRESS_EVERY_S = 5.0

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


# ----------------------------------------------------------------------------- model


def build_model(
    python: str,
    cache_dir: Path | None = None,
    *,
    progress: Progress = _quiet,
    force: bool = False,
    timeout: float = BUILD_TIMEOUT_S,
) -> Path:
    """Build (or reuse) the tiny model with ``python``; return its folder for ``--model``.

    The build needs torch and transformers, so it runs as ``python -m
    gateway_lab.vllm_cpu.model_builder`` with the vLLM interpreter; reusing a finished build needs
    neither. ``cache_dir`` defaults to ``$EXTPROC_MODEL_CACHE`` or ``~/.cache/extproc``.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = model_dir(cache)
    if is_built(target) and not force:
        progress(f"model: reusing {target}")
        return target
    progress(f"model: building the tiny offline Llama into {target} (about 6-10 s)")
    command = [python, "-m", "gateway_lab.vllm_cpu.model_builder", "--cache-dir", str(cache)]
    if force:
        command.append("--force")
    started = time.monotonic()
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmStartError(f"model build failed: {exc}") from exc
    if done.returncode != 0 or not is_built(target):
        output = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise VllmStartError(
            f"model build with {python} failed (exit code {done.returncode}); output tail:\n"
            f"{output}"
        )
    progress(f"model: built in {time.monotonic() - started:.1f} s")
    return target


# ----------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM server for one pool endpoint."""

    pool: str
    index: int
    host: str
    port: int
    preset: PoolPreset

    @property
    def name(self) -> str:
        return f"vllm {self.pool}#{self.index}"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"


def _usable_cores() -> list[int]:
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = list(range(os.cpu_count() or 1))
    return cores or [0]


def is_pooling_pool(serves: Sequence[str]) -> bool:
    """A pool whose engines run a pooling model: it serves no generative class."""
    return not set(serves) & GENERATIVE_CLASSES


def engine_specs(policy: Policy, cores: Sequence[int] | None = None) -> list[EngineSpec]:
    """One :class:`EngineSpec` per pool endpoint, in the policy's order.

    The pool with the smallest ``max_total_tokens`` gets :data:`SHORT_POOL`'s shape, the others
    :data:`LONG_POOL`'s; ``max_model_len`` is the pool's ``max_total_tokens`` capped at
    :data:`MODEL_MAX_LEN`, and the KV cache holds at least one request of that length (plus
    the block vLLM keeps aside). Engine
    ``i`` is pinned to ``cores[i % len(cores)]``. Raises RuntimeError for a non-loopback
    endpoint.
    """
    usable = list(cores) if cores else _usable_cores()
    pooling = {name for name, pool in policy.pools.items() if is_pooling_pool(pool.serves)}
    generative = [name for name in policy.pools if name not in pooling] or list(policy.pools)
    smallest = min(generative, key=lambda name: policy.pools[name].max_total_tokens)
    specs = []
    for index, (pool, endpoint) in enumerate(engine_endpoints(policy)):
        host, port = split_host_port(endpoint)
        shape = SHORT_POOL if pool == smallest else LONG_POOL
        base = POOLING_POOL if pool in pooling else shape
        max_model_len = min(policy.pools[pool].max_total_tokens, MODEL_MAX_LEN)
        # vLLM keeps one block aside (the null block): one more than the longest request.
        blocks = max(base.kv_cache_blocks or 0, math.ceil(max_model_len / KV_BLOCK_TOKENS) + 1)
        # A pooling engine takes a whole input into one step.
        batched = max(base.max_num_batched_tokens, max_model_len if base.runner else 0)
        preset = dataclasses.replace(
            base,
            name=pool,
            max_model_len=max_model_len,
            max_num_batched_tokens=batched,
            kv_cache_blocks=blocks,
            cpu_bind=str(usable[index % len(usable)]),
        )
        specs.append(EngineSpec(pool, index, host, int(port), preset))
    return specs


def readiness_urls(policy: Policy) -> list[tuple[str, str]]:
    """(``/health`` URL, child name) for every engine :func:`vllm_children` starts."""
    return [(spec.health_url, spec.name) for spec in engine_specs(policy)]


@dataclass
class VllmChild(Child):
    """A vLLM server: three processes (API server, engine core, worker) in one session.

    ``stop`` and ``kill`` signal the whole process group the child started, so no engine core
    or worker is left behind even when the API server is killed.
    """

    stop_timeout: float = STOP_TIMEOUT_S
    health_url: str = ""

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def _group_alive(self) -> bool:
        if self.process is None:
            return False
        try:
            os.killpg(self.process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop(self, timeout: float | None = None) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        # The API server is gone; its engine core and worker follow within a few seconds.
        deadline = time.monotonic() + 10.0
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_alive():
            self._signal_group(signal.SIGKILL)

    def kill(self, wait: bool = True) -> None:
        if self.process is None:
            return
        self._signal_group(signal.SIGKILL)
        if wait:
            self.process.wait()


def vllm_children(
    policy: Policy,
    workdir: Path,
    python: str,
    *,
    model: Path | None = None,
    served_model_names: Sequence[str] = SERVED_MODEL_NAMES,
    accept_any_model: bool = True,
    progress: Progress = _quiet,
    scheduling_policy: str | None = None,
) -> list[Child]:
    """One :class:`VllmChild` per pool endpoint of ``policy`` (not started).

    ``python`` is the interpreter with vLLM installed. ``model`` defaults to the tiny model,
    built now if needed (see :func:`build_model`). Logs go to ``workdir/vllm-POOL-I.log``.
    ``scheduling_policy`` replaces the presets' ``--scheduling-policy`` (benchmarks compare
    "fcfs" with the shipped "priority").
    """
    if model is None:
        model = build_model(python, progress=progress)
    children: list[Child] = []
    for spec in engine_specs(policy):
        preset = spec.preset
        if scheduling_policy is not None:
            preset = dataclasses.replace(preset, scheduling_policy=scheduling_policy)
        if preset.max_model_len < policy.pools[spec.pool].max_total_tokens:
            progress(
                f"{spec.name}: context capped at {preset.max_model_len} tokens (the tiny model's "
                f"limit; the policy allows {policy.pools[spec.pool].max_total_tokens})"
            )
        command = preset_command(
            model,
            spec.port,
            preset,
            served_model_name=served_model_names,
            host=spec.host,
            python=python,
        )
        env = vllm_env(preset.cpu_bind, preset.kv_cache_gib, accept_any_model=accept_any_model)
        children.append(
            VllmChild(
                name=spec.name,
                command=command,
                log_path=Path(workdir) / f"vllm-{spec.pool}-{spec.index}.log",
                env=env,
                stop_rank=STOP_MIDDLE,
                health_url=spec.health_url,
            )
        )
    return children


_VLLM_LOG_PREFIX = re.compile(
    r"^\((?:APIServer|EngineCore|Worker)[^)]*\)\s+"
    r"(?:(?:DEBUG|INFO|WARNING|ERROR)\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[[^\]]*\]\s*)?"
)


def _last_line(path: Path, width: int = 90) -> str:
    """The log's last line without vLLM's ``(Process pid=N) INFO date [file:line]`` prefix."""
    lines = [line for line in log_tail(path, 5).splitlines() if line.strip()]
    if not lines or lines[0].startswith("(cannot read"):
        return ""
    text = _VLLM_LOG_PREFIX.sub("", lines[-1].strip())
    return text if len(text) <= width else text[: width - 3] + "..."


def wait_engines_ready(
    stack: Stack,
    *,
    timeout: float = READY_TIMEOUT_S,
    abort: Callable[[], bool] | None = None,
    progress: Progress = _quiet,
    progress_every: float = _PROGRESS_EVERY_S,
) -> dict[str, float]:
    """Wait until every started :class:`VllmChild` of ``stack`` answers ``/health``.

    Returns each engine's seconds from the wait's start to ready. Prints (via ``progress``)
    which engines are still starting, with their log's last line, every ``progress_every``
    seconds. Raises :class:`VllmStartError` (a RuntimeError) with the log tail when any child of
    the stack exits, or with every pending engine's log tail after ``timeout``; RuntimeError
    when ``abort()`` turns true.
    """
    pending = {c.name: c for c in stack.children if isinstance(c, VllmChild) and c.health_url}
    ready: dict[str, float] = {}
    start = time.monotonic()
    next_report = start + progress_every
    while pending:
        for name, child in list(pending.items()):
            if http_ok(child.health_url, timeout=1.0):
                ready[name] = time.monotonic() - start
                progress(f"{name}: ready in {ready[name]:.1f} s")
                del pending[name]
        if not pending:
            break
        if abort is not None and abort():
            raise RuntimeError("stopped while waiting for the vLLM engines")
        dead = stack.dead()
        if dead is not None:
            code = dead.process.returncode if dead.process is not None else None
            raise VllmStartError(
                f"{dead.name} exited (code {code}) while the vLLM engines were starting; "
                f"log {dead.log_path}, tail:\n{dead.log_tail(60)}"
            )
        now = time.monotonic()
        if now - start > timeout:
            tails = "\n".join(
                f"--- {name} (log {child.log_path}):\n{child.log_tail(40)}"
                for name, child in pending.items()
            )
            raise VllmStartError(
                f"vLLM engines not ready after {timeout:.0f} s: {', '.join(pending)}\n{tails}"
            )
        if now >= next_report:
            waiting = "; ".join(
                f"{name}: {_last_line(child.log_path) or 'starting'}"
                for name, child in pending.items()
            )
            progress(f"waiting for vLLM ({now - start:.0f} s) - {waiting}")
            next_report = now + progress_every
        time.sleep(0.5)
    return ready
