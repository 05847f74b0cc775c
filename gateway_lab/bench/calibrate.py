"""Benchmark: calibrate the emulator's "cpu-tiny" profile against a real vLLM (CPU) engine.

`extproc bench calibrate [--vllm-python .venv-vllm/bin/python] [--out results/calibration]`

The same workload runs directly (no gateway) against

- **real**: one vLLM server with the short-pool preset
  (``gateway_lab.vllm_cpu.launcher.SHORT_POOL``:
  max-num-seqs 32, max-num-batched-tokens 2048, 128 KV blocks of 128 tokens, eager, worker
  pinned to core 0) serving the tiny offline Llama, started with ``--vllm-python``;
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
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

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

DEFAULT_OUT = Path("results/calibration")
DEFAULT_PROFILE = "cpu-tiny"
MODEL = "tiny-llama"
TOKEN_ID_RANGE = (1_000, 100_000)  # ordinary cl100k ids; specials start at 100,256
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
BURST_ITL_S = 0.0005


@dataclass(frozen=True)
class Workload:
    levels: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 200
    output_tokens: int = 64
    min_requests_per_level: int = 16
    short_prompt_tokens: int = 50
    short_output_tokens: int = 16
    long_prompt_tokens: int = 1800
    long_output_tokens: int = 16
    long_counts: tuple[int, ...] = (0, 1, 2, 4)
    repeats: int = 3
    long_head_start_s: float = 0.02
    rounds: int = 3
    seed: int = 7


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    itl_s: float | None
    e2e_s: float
    tokens: int

    @property
    def burst(self) -> bool:
        """The stream reached the client in one burst at its end (tokens < 0.5 ms apart on
        average, far below any engine step): the server's HTTP side was stalled, so the
        arrival of the first chunk says nothing about when the engine produced it."""
        return self.tokens >= 4 and self.itl_s is not None and self.itl_s < BURST_ITL_S


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    output_tokens_per_s: float
    engine_ttft_mean_ms: float = math.nan
    burst_delivered: int = 0
    """Streams delivered in one burst (host stall); left out of the TTFT and ITL figures."""
    """TTFT as the engine itself reports it (mean of its vllm:time_to_first_token_seconds)."""


@dataclass
class InterferenceResult:
    long_prompts: int
    long_prompt_tokens: int
    short_ttft_p50_ms: float
    short_ttft_max_ms: float
    samples: int = 0
    burst_delivered: int = 0


@dataclass
class EngineResult:
    engine: str
    description: str
    levels: list[LevelResult] = field(default_factory=list)
    interference: list[InterferenceResult] = field(default_factory=list)
    startup_s: float | None = None
    load_1m: list[float] = field(default_factory=list)
    """The machine's 1-minute load average when each round started (2 cores: 2.0 is full)."""


# ----------------------------------------------------------------------------- load generation


def _prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(tokens)]


async def _request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> Timing:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    start = time.perf_counter()
    first: float | None = None
    last = start
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = orjson.loads(line[5:])
            if not chunk.get("choices"):
                continue  # the final usage-only chunk
            usage = chunk.get("usage") or {}
            count = usage.get("completion_tokens")
            tokens = int(count) if isinstance(count, int) else tokens + 1
            if tokens >= 1 and first is None:
                first = now
            last = now
    if first is None or tokens < 1:
        raise RuntimeError(f"{url}: a stream without tokens")
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return Timing(first - start, itl, last - start, tokens)


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


TTFT_METRIC = "vllm:time_to_first_token_seconds"


async def _histogram(session: aiohttp.ClientSession, url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on an engine's /metrics page, over all label sets."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def _level_round(
    session: aiohttp.ClientSession, url: str, concurrency: int, work: Workload, rng: random.Random
) -> tuple[list[Timing], float]:
    """One closed-loop round: ``concurrency`` clients, each sending requests back to back."""
    per_client = max(2, math.ceil(work.min_requests_per_level / concurrency))
    prompts = [
        [_prompt(rng, work.prompt_tokens) for _ in range(per_client)] for _ in range(concurrency)
    ]

    async def client(mine: list[list[int]]) -> list[Timing]:
        return [await _request(session, url, p, work.output_tokens) for p in mine]

    start = time.perf_counter()
    results = await asyncio.gather(*(client(mine) for mine in prompts))
    wall = time.perf_counter() - start
    return [t for batch in results for t in batch], wall


def _level_result(
    concurrency: int, timings: list[Timing], wall: float, engine_ttft: tuple[float, float]
) -> LevelResult:
    clean = [t for t in timings if not t.burst]
    itls = [t.itl_s for t in clean if t.itl_s is not None] or [math.nan]
    ttfts = [t.ttft_s for t in clean] or [math.nan]
    ttft_sum, ttft_count = engine_ttft
    return LevelResult(
        concurrency=concurrency,
        requests=len(timings),
        wall_s=round(wall, 3),
        ttft_p50_ms=round(statistics.median(ttfts) * 1000, 2),
        ttft_p90_ms=round(_pct(ttfts, 0.9) * 1000, 2),
        itl_p50_ms=round(statistics.median(itls) * 1000, 2),
        output_tokens_per_s=round(sum(t.tokens for t in timings) / wall, 1),
        engine_ttft_mean_ms=round(ttft_sum / ttft_count * 1000, 2) if ttft_count else math.nan,
        burst_delivered=len(timings) - len(clean),
    )


async def _interference_round(
    session: aiohttp.ClientSession,
    url: str,
    long_count: int,
    work: Workload,
    rng: random.Random,
) -> list[Timing]:
    """The short request's timings, each sent just after ``long_count`` long prompts."""
    ttfts = []
    for _ in range(work.repeats):
        longs = [
            asyncio.create_task(
                _request(
                    session, url, _prompt(rng, work.long_prompt_tokens), work.long_output_tokens
                )
            )
            for _ in range(long_count)
        ]
        await asyncio.sleep(work.long_head_start_s)
        short = await _request(
            session, url, _prompt(rng, work.short_prompt_tokens), work.short_output_tokens
        )
        await asyncio.gather(*longs)
        ttfts.append(short)
    return ttfts


@dataclass
class _Samples:
    """Every sample one engine gave, pooled over rounds."""

    work: Workload
    timings: dict[int, list[Timing]] = field(default_factory=dict)
    walls: dict[int, float] = field(default_factory=dict)
    engine_ttft: dict[int, tuple[float, float]] = field(default_factory=dict)
    shorts: dict[int, list[Timing]] = field(default_factory=dict)
    load_1m: list[float] = field(default_factory=list)

    def result(self, engine: str, description: str) -> EngineResult:
        result = EngineResult(engine=engine, description=description)
        for concurrency in self.work.levels:
            timings = self.timings[concurrency]
            engine_ttft = self.engine_ttft.get(concurrency, (0.0, 0.0))
            result.levels.append(
                _level_result(concurrency, timings, self.walls[concurrency], engine_ttft)
            )
        for count in self.work.long_counts:
            shorts = self.shorts[count]
            ttfts = [t.ttft_s for t in shorts if not t.burst] or [math.nan]
            result.interference.append(
                InterferenceResult(
                    long_prompts=count,
                    long_prompt_tokens=count * self.work.long_prompt_tokens,
                    short_ttft_p50_ms=round(statistics.median(ttfts) * 1000, 2),
                    short_ttft_max_ms=round(max(ttfts) * 1000, 2),
                    samples=len(shorts),
                    burst_delivered=sum(t.burst for t in shorts),
                )
            )
        result.load_1m = [round(x, 2) for x in self.load_1m]
        return result


async def _warm_up(
    session: aiohttp.ClientSession, url: str, work: Workload, rng: random.Random
) -> None:
    """First requests pay one-off costs (allocation, lazy init) on both engines."""
    for _ in range(3):
        await _request(session, url, _prompt(rng, work.prompt_tokens), 8)
    await asyncio.gather(
        *(_request(session, url, _prompt(rng, work.prompt_tokens), 8) for _ in range(8))
    )


def _session() -> aiohttp.ClientSession:
    """A fresh client per phase: a pooled connection left idle longer than the server's
    keep-alive (uvicorn: 5 s) may be closed under us ("Server disconnected")."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def _round(url: str, work: Workload, rng: random.Random, samples: _Samples) -> None:
    samples.load_1m.append(os.getloadavg()[0])
    for concurrency in work.levels:
        async with _session() as session:
            before = await _histogram(session, url, TTFT_METRIC)
            timings, wall = await _level_round(session, url, concurrency, work, rng)
            after = await _histogram(session, url, TTFT_METRIC)
        samples.timings.setdefault(concurrency, []).extend(timings)
        samples.walls[concurrency] = samples.walls.get(concurrency, 0.0) + wall
        total, count = samples.engine_ttft.get(concurrency, (0.0, 0.0))
        samples.engine_ttft[concurrency] = (
            total + after[0] - before[0],
            count + after[1] - before[1],
        )
    for count in work.long_counts:
        async with _session() as session:
            shorts = await _interference_round(session, url, count, work, rng)
        samples.shorts.setdefault(count, []).extend(shorts)


@dataclass(frozen=True)
class Target:
    """A running engine to measure."""

    engine: str
    url: str
    description: str
    startup_s: float | None = None


async def measure(targets: Sequence[Target], work: Workload) -> list[EngineResult]:
    """Run the workload ``work.rounds`` times against every target, alternating targets round
    by round (and which goes first), so both see the same background load on a shared machine.
    Samples are pooled per target; only one engine is loaded at any time."""
    samples = {t.engine: _Samples(work) for t in targets}
    rngs = {t.engine: random.Random(work.seed) for t in targets}
    for target in targets:
        async with _session() as session:
            await _warm_up(session, target.url, work, rngs[target.engine])
    for index in range(work.rounds):
        order = list(targets) if index % 2 == 0 else list(reversed(targets))
        for target in order:
            await _round(target.url, work, rngs[target.engine], samples[target.engine])
        print(f"  round {index + 1}/{work.rounds} done", flush=True)
    results = []
    for target in targets:
        result = samples[target.engine].result(target.engine, target.description)
        result.startup_s = target.startup_s
        for level in result.levels:
            print(f"  {target.engine}: {level}", flush=True)
        for found in result.interference:
            print(f"  {target.engine}: {found}", flush=True)
        results.append(result)
    return results


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


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Row:
    metric: str
    real: float
    emulated: float
    checked: bool

    @property
    def ratio(self) -> float:
        return self.emulated / self.real if self.real else math.nan


def compare(real: EngineResult, emulated: EngineResult) -> list[Row]:
    rows = []
    for r, e in zip(real.levels, emulated.levels, strict=True):
        c = r.concurrency
        # With one request in flight vLLM's busy-polling engine core and pinned worker take
        # ~1.7 of the 2 cores; with other load on the machine its API server is starved and
        # delays the first chunk (up to the whole stream, see docs/vllm.md). There the engine's
        # own TTFT histogram is the checked figure; the client's is shown beside it.
        solo = c == 1
        rows.append(Row(f"TTFT p50 @{c} (ms)", r.ttft_p50_ms, e.ttft_p50_ms, not solo))
        rows.append(Row(f"TTFT p90 @{c} (ms)", r.ttft_p90_ms, e.ttft_p90_ms, False))
        rows.append(
            Row(f"engine TTFT mean @{c} (ms)", r.engine_ttft_mean_ms, e.engine_ttft_mean_ms, solo)
        )
        rows.append(Row(f"ITL p50 @{c} (ms)", r.itl_p50_ms, e.itl_p50_ms, True))
        rows.append(Row(f"output tok/s @{c}", r.output_tokens_per_s, e.output_tokens_per_s, False))
    for ri, ei in zip(real.interference, emulated.interference, strict=True):
        rows.append(
            Row(
                f"short TTFT p50, {ri.long_prompts} long (ms)",
                ri.short_ttft_p50_ms,
                ei.short_ttft_p50_ms,
                True,
            )
        )
    return rows


def render_table(rows: Sequence[Row], tolerance: float) -> str:
    lines = [
        f"| {'metric':<32} | {'real':>9} | {'emulated':>9} | {'emu/real':>8} | {'':<4} |",
        f"| {'-' * 32} | {'-' * 9}: | {'-' * 9}: | {'-' * 8}: | {'-' * 4} |",
    ]
    for row in rows:
        verdict = ("ok" if abs(row.ratio - 1) <= tolerance else "OUT") if row.checked else ""
        lines.append(
            f"| {row.metric:<32} | {row.real:>9.1f} | {row.emulated:>9.1f} | "
            f"{row.ratio:>8.2f} | {verdict:<4} |"
        )
    return "\n".join(lines)


def save_png(path: Path, results: Sequence[EngineResult]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no PNG", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for result in results:
        style = "o-" if result.engine == "real" else "s--"
        levels = [x.concurrency for x in result.levels]
        line = axes[0].plot(
            levels,
            [x.ttft_p50_ms for x in result.levels],
            style,
            label=f"{result.engine} (client p50)",
        )[0]
        axes[0].plot(
            levels,
            [x.engine_ttft_mean_ms for x in result.levels],
            ":",
            color=line.get_color(),
            label=f"{result.engine} (engine's own mean)",
        )
        axes[1].plot(levels, [x.itl_p50_ms for x in result.levels], style, label=result.engine)
        axes[2].plot(
            [x.long_prompt_tokens for x in result.interference],
            [x.short_ttft_p50_ms for x in result.interference],
            style,
            label=result.engine,
        )
    axes[0].set(title="TTFT p50 vs load", xlabel="concurrent requests", ylabel="ms", xscale="log")
    axes[1].set(title="inter-token p50 vs load", xlabel="concurrent requests", ylabel="ms")
    axes[1].set_xscale("log")
    axes[2].set(
        title="short request TTFT p50 vs co-scheduled long prompts",
        xlabel="long prompt tokens arriving first",
        ylabel="ms",
    )
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _burst_note(*results: EngineResult) -> str:
    parts = []
    for result in results:
        counts = [f"@{x.concurrency} {x.burst_delivered}/{x.requests}" for x in result.levels]
        counts += [
            f"{x.long_prompts} long {x.burst_delivered}/{x.samples}" for x in result.interference
        ]
        load = ", ".join(f"{x:.1f}" for x in result.load_1m)
        parts.append(f"{result.engine}: {'; '.join(counts)} (load per round: {load})")
    return "burst-delivered streams, left out:\n  " + "\n  ".join(parts)


def _nan(row: dict[str, Any]) -> dict[str, Any]:
    return {k: math.nan if v is None else v for k, v in row.items()}


def _no_nan(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def _load_engine(data: dict[str, Any]) -> EngineResult:
    return EngineResult(
        engine=data["engine"],
        description=data["description"],
        levels=[LevelResult(**_nan(x)) for x in data["levels"]],
        interference=[InterferenceResult(**_nan(x)) for x in data["interference"]],
        startup_s=data.get("startup_s"),
        load_1m=data.get("load_1m", []),
    )


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
                real = _load_engine(json.loads(Path(args.real_json).read_text())["real"])
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
        print(_burst_note(real, emulated))
        report["comparison"] = [{**asdict(r), "ratio": round(r.ratio, 3)} for r in rows]
        report["out_of_tolerance"] = out_of_tolerance
    report["seconds"] = round(time.monotonic() - started, 1)
    (out / "calibration.json").write_text(json.dumps(_no_nan(report), indent=2) + "\n")
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
