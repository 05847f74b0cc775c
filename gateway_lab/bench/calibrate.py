"""Benchmark: calibrate the emulator's "cpu-tiny" profile against a real vLLM (CPU) engine.

`extproc bench calibrate [--vllm-python .venv-vllm/bin/python] [--out results/calibration]`

The same workload runs directly (no gateway) against

- **real**: one vLLM server with the short-pool preset
  (``gateway_lab.vllm_cpu.launcher.SHORT_POOL``:
  max-num-seqs 32, max-num-batched-tokens 2048, 128 KV blocks of 128 tokens, eager, worker
  pinned to core 0, scheduling policy priority, long-prefill-token-threshold 256) serving the
  tiny offline Llama, started with ``--vllm-python``;
- **emulated**: ``extproc engine --profile cpu-tiny`` in a subprocess (plus ``--set`` overrides).

Workload, streamed ``/v1/completions`` with ``ignore_eos`` and continuous usage stats (the
token count in every chunk gives exact first-token and inter-token times); prompts are random
token ids, so neither engine can reuse a cached prefix and both count them identically:

1. load: 1, 8 and 32 concurrent clients in a closed loop, each prompt 200 tokens, 64 out.
   Reported: TTFT p50/p90, inter-token latency (ITL, per request (last - first) / (n - 1))
   p50, output tokens/s.
2. noisy neighbours: a short request (50 in, 16 out) sent 20 ms after 0, 1, 2 or 4 long
   prompts (1,800 tokens, 16 out) that arrived together; reported: the short request's TTFT
   p50 over ``--repeats`` rounds.

Both engines run at once and are measured in alternate rounds (``--rounds``, order flipped each
round), so bursts of other load on a shared machine fall on both; samples are pooled. Streams
that reach the client in one burst (a stalled server, see docs/vllm.md) carry no first-token
timing: they are left out of the latency figures and counted.

The table shows real, emulated and emulated/real per metric; "ok" marks the checked medians
within ``--tolerance`` (default 30%): TTFT p50 at 8+ requests (at 1 request the engine's own
TTFT histogram mean, as the client's is dominated by host stalls), ITL p50 at every level and
the short request's TTFT p50 in every noisy-neighbour case. Results go to
``OUT/calibration.json`` and ``OUT/calibration.png``. ``--real-json`` reuses a saved real
measurement (tune the profile without restarting vLLM); ``--check`` exits 1 when a checked
median is out of tolerance. docs/calibration.md has the method and the latest table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

from gateway_lab.bench.calibrate_measure import (
    MODEL,
    EngineResult,
    InterferenceResult,
    LevelResult,
    Target,
    Timing,
    Workload,
    measure,
)
from gateway_lab.bench.calibrate_report import (
    burst_note,
    compare,
    load_engine,
    no_nan,
    render_table,
    save_png,
)
from gateway_lab.engine.profiles import get_profile
from gateway_lab.vllm_cpu.launcher import (
    SHORT_POOL,
    VllmStartError,
    free_port,
    start_server,
    stop_process_group,
    vllm_python,
    wait_ready,
)

__all__ = [
    "EngineResult",
    "InterferenceResult",
    "LevelResult",
    "Timing",
    "add_arguments",
    "compare",
    "main",
    "render_table",
]

DEFAULT_OUT = Path("results/calibration")
DEFAULT_PROFILE = "cpu-tiny"
READY_TIMEOUT_S = 300.0


# ----------------------------------------------------------------------------- engines


def _start_real(args: argparse.Namespace, log_dir: Path, stack: contextlib.ExitStack) -> Target:
    from gateway_lab.vllm_cpu.stack import build_model

    python = args.vllm_python or vllm_python()
    model = (
        Path(args.model_dir)
        if args.model_dir
        else build_model(python, progress=lambda m: print(f"  {m}", flush=True))
    )
    port = free_port()
    print(f"real: starting vLLM ({python}) on port {port}, log in {log_dir}", flush=True)
    server = start_server(model, SHORT_POOL, port, log_dir, python=python)
    stack.callback(server.stop)
    startup = server.wait_ready(READY_TIMEOUT_S)
    print(f"real: ready in {startup:.1f} s", flush=True)
    description = (
        f"vllm-cpu short preset: max_num_seqs {SHORT_POOL.max_num_seqs}, "
        f"max_num_batched_tokens {SHORT_POOL.max_num_batched_tokens}, "
        f"{SHORT_POOL.kv_cache_blocks} KV blocks x 128, eager, worker on core {SHORT_POOL.cpu_bind}"
        f", {SHORT_POOL.scheduling_policy} policy, prefill threshold "
        f"{SHORT_POOL.long_prefill_token_threshold or 'off'}"
    )
    return Target("real", server.base_url, description, round(startup, 1))


def _overrides(pairs: Sequence[str]) -> dict[str, float | int]:
    overrides: dict[str, float | int] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set expects FIELD=VALUE, got {pair!r}")
        number = float(value)
        integral = number.is_integer() and "." not in value and "e" not in value.lower()
        overrides[name.strip()] = int(number) if integral else number
    return overrides


def _start_emulated(
    profile_name: str,
    overrides: dict[str, float | int],
    log_dir: Path,
    stack: contextlib.ExitStack,
) -> Target:
    profile = get_profile(profile_name, **overrides)  # validates the overrides first
    port = free_port()
    command = [
        sys.executable, "-m", "extproc", "engine", "--profile", profile_name,
        "--port", str(port), "--model", MODEL, "--accept-any-model",
    ]  # fmt: skip
    for name, value in overrides.items():
        command += ["--" + name.replace("_", "-"), str(value)]
    log_path = log_dir / f"emulator-{port}.log"
    print(f"emulated: starting extproc engine --profile {profile_name} on port {port}", flush=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    stack.callback(stop_process_group, proc, 10)
    startup = wait_ready(f"http://127.0.0.1:{port}", proc, 60.0, log_path=log_path)
    description = ", ".join(f"{k} {v}" for k, v in asdict(profile).items() if k != "name")
    return Target("emulated", f"http://127.0.0.1:{port}", f"{profile_name}: {description}",
                  round(startup, 1))  # fmt: skip


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter with vllm-cpu installed (default $EXTPROC_VLLM_PYTHON or this one)",
    )
    parser.add_argument(
        "--model-dir", default=None, help="model folder (default: build or reuse the tiny model)"
    )
    parser.add_argument("--profile", default=DEFAULT_PROFILE, help="emulator profile to compare")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a profile field for this run (repeatable), e.g. step_base_s=0.004",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for JSON and PNG")
    parser.add_argument(
        "--real-json",
        type=Path,
        default=None,
        help="reuse the real engine's results from a saved calibration.json instead of vLLM",
    )
    parser.add_argument("--levels", default="1,8,32", help="concurrency levels")
    parser.add_argument(
        "--rounds", type=int, default=3, help="times the whole workload runs (samples pooled)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="short requests per noisy-neighbour case per round"
    )
    parser.add_argument(
        "--engines",
        default="real,emulated",
        help="which engines to measure: real, emulated or both (default %(default)s)",
    )
    parser.add_argument("--tolerance", type=float, default=0.30, help="allowed |emu/real - 1|")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when a checked median is out of tolerance"
    )


def main(args: argparse.Namespace) -> int:
    work = Workload(
        levels=tuple(int(x) for x in str(args.levels).split(",") if x.strip()),
        repeats=args.repeats,
        rounds=args.rounds,
    )
    engines = {e.strip() for e in str(args.engines).split(",") if e.strip()}
    if not engines or not engines <= {"real", "emulated"}:
        print("extproc bench calibrate: --engines takes real, emulated or both", file=sys.stderr)
        return 2
    try:
        overrides = _overrides(args.overrides)
        profile = get_profile(args.profile, **overrides)
    except ValueError as exc:
        print(f"extproc bench calibrate: {exc}", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="calibrate-logs-"))
    started = time.monotonic()
    real: EngineResult | None = None
    emulated: EngineResult | None = None
    try:
        with contextlib.ExitStack() as running:
            targets = []
            if args.real_json is not None:
                real = load_engine(json.loads(Path(args.real_json).read_text())["real"])
                print(f"real: reusing {args.real_json}", flush=True)
            elif "real" in engines:
                targets.append(_start_real(args, log_dir, running))
            if "emulated" in engines:
                targets.append(_start_emulated(args.profile, overrides, log_dir, running))
            for result in asyncio.run(measure(targets, work)):
                if result.engine == "real":
                    real = result
                else:
                    emulated = result
    except (VllmStartError, RuntimeError, OSError, aiohttp.ClientError) as exc:
        print(f"extproc bench calibrate: {exc}\n(logs in {log_dir})", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "argv": sys.argv,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "workload": asdict(work),
        "tolerance": args.tolerance,
        "profile": asdict(profile),
        "overrides": overrides,
        "real": None if real is None else asdict(real),
        "emulated": None if emulated is None else asdict(emulated),
    }
    out_of_tolerance: list[str] = []
    if real is not None and emulated is not None:
        rows = compare(real, emulated)
        checked = [r for r in rows if r.checked]
        out_of_tolerance = [r.metric for r in checked if abs(r.ratio - 1) > args.tolerance]
        print()
        print(render_table(rows, args.tolerance))
        print(
            f"\nchecked medians within {args.tolerance:.0%}: "
            f"{len(checked) - len(out_of_tolerance)}/{len(checked)}"
            + (f"; out: {', '.join(out_of_tolerance)}" if out_of_tolerance else "")
        )
        print(burst_note(real, emulated))
        report["comparison"] = [{**asdict(r), "ratio": round(r.ratio, 3)} for r in rows]
        report["out_of_tolerance"] = out_of_tolerance
    report["seconds"] = round(time.monotonic() - started, 1)
    (out / "calibration.json").write_text(json.dumps(no_nan(report), indent=2) + "\n")
    saved = [out / "calibration.json"]
    if save_png(out / "calibration.png", [r for r in (real, emulated) if r is not None]):
        saved.append(out / "calibration.png")
    print("saved " + " and ".join(str(path) for path in saved))
    return 1 if args.check and out_of_tolerance else 0


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway_lab.bench.calibrate", description=(__doc__ or "").splitlines()[0]
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_cli())
