"""The noisy-neighbour arms that reach into the engine (issue 15): engine priority on and off,
prefill pacing, the δ controller at a few objectives; which arms to run, how the engine is
started for them, and their verdict against the isolation targets."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol, TypeVar

from gateway_lab.bench.loadgen import Load
from gateway_lab.bench.noisy_plot import (
    ISOLATION_GAP_RATIO,
    ISOLATION_TTFT_RATIO,
    TARGET_THROUGHPUT,
)
from gateway_lab.bench.records import Spec

# Issue 15's targets: quiet P99 TTFT <= 2.0x alone (ISOLATION_TTFT_RATIO) and P99 inter-token
# gap <= 1.5x alone (ISOLATION_GAP_RATIO: every gap, not the per-response time per output
# token), at >= 95% of FIFO's total throughput.


class _Named(Protocol):
    @property
    def name(self) -> str: ...


ArmT = TypeVar("ArmT", bound=_Named)
TimingT = TypeVar("TimingT")


DEFAULT_TAIL_QUANTILE = 0.99


@dataclass(frozen=True)
class Isolation:
    engine_policy: str = "priority"
    """The engine's --scheduling-policy for every arm (direct arms send no priority: FIFO)."""
    budget: int = 4096
    """prefill_budget_tokens of the paced and delta arms."""
    deltas: tuple[str, ...] = ("100ms", "300ms")
    first_deltas: tuple[str, ...] = ("50ms", "150ms")
    """First-token objectives of the first-D arms."""
    tail_deltas: tuple[str, ...] = ("100ms",)
    """Every-token objectives of the tail-D arms, bounded at `tail_quantile`."""
    tail_quantile: float = DEFAULT_TAIL_QUANTILE
    step_tokens: tuple[int, ...] = (512,)
    """--max-num-batched-tokens of the step-N arms' own engines."""
    arms: tuple[str, ...] = ()
    """Only these arms (empty: all)."""
    prefill_threshold: int = 0
    """The engine's --long-prefill-token-threshold (0: off)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Isolation:
        return cls(
            engine_policy=args.engine_policy,
            budget=args.prefill_budget,
            deltas=listed(args.deltas),
            first_deltas=listed(args.first_token_deltas),
            tail_deltas=listed(args.tail_deltas),
            tail_quantile=args.tail_quantile,
            step_tokens=tuple(int(n) for n in listed(args.step_tokens)),
            arms=listed(args.arms or ""),
            prefill_threshold=args.engine_prefill_threshold,
        )

    def engine_args(self) -> list[str]:
        threshold = ["--long-prefill-token-threshold", str(self.prefill_threshold)]
        return ["--scheduling-policy", self.engine_policy, *threshold]

    def select(self, arms: Sequence[ArmT]) -> list[ArmT]:
        if not self.arms:
            return list(arms)
        known = {arm.name for arm in arms}
        unknown = sorted(set(self.arms) - known)
        if unknown:
            raise SystemExit(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return [arm for arm in arms if arm.name in self.arms]


DEFAULT_ISOLATION = Isolation()


def tail_objective(objective: str, quantile: float) -> str:
    """The tail arms' `latency_delta` (YAML flow text): every token's lag at most `objective`
    for a share `quantile` of them."""
    return f"{{every_token: {objective}, quantile: {quantile:g}}}"


def add_tail_quantile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tail-quantile", type=float, default=DEFAULT_TAIL_QUANTILE,
        help="the quantile the tail arms' objective bounds (default %(default)s)",
    )  # fmt: skip


def listed(text: str) -> tuple[str, ...]:
    """The items of a comma-separated option, stripped, empty ones dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def add_isolation_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `Isolation`, with its defaults."""
    default = DEFAULT_ISOLATION
    parser.add_argument(
        "--engine-policy", choices=("priority", "fcfs"), default=default.engine_policy,
        help="the engine's --scheduling-policy (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-budget", type=int, default=default.budget,
        help="prefill_budget_tokens of the paced and delta arms (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--deltas", default=",".join(default.deltas),
        help="latency_delta objectives of the delta arms (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--step-tokens", default=",".join(map(str, default.step_tokens)),
        help="--max-num-batched-tokens of the step-N arms' own engines (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--first-token-deltas", default=",".join(default.first_deltas),
        help="first-token objectives of the first-D arms (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--tail-deltas", default=",".join(default.tail_deltas),
        help="every-token objectives of the tail-D arms (default %(default)s)",
    )  # fmt: skip
    add_tail_quantile_argument(parser)
    parser.add_argument(
        "--engine-prefill-threshold", type=int, default=default.prefill_threshold,
        help="the engine's --long-prefill-token-threshold (default %(default)s: off)",
    )  # fmt: skip
    parser.add_argument("--arms", help="run only these arms, comma separated")
    parser.add_argument("--warmup", type=float, help="seconds of warm-up for every arm")


ALONE_PRIMING = 6
"""Quiet requests a delta arm sends one at a time first (the alone model needs 3)."""


async def prime_alone(load: Load, make: Callable[[int], Spec]) -> None:
    """Requests one at a time on the idle pool, so the gateway learns the alone latency."""
    for index in range(ALONE_PRIMING):
        record = await load.send(make(index))
        if record.status != 200:
            raise SystemExit(f"priming request {index} got {record.status}")


def with_warmup(timing: TimingT, seconds: float) -> TimingT:
    """The timing with every warm-up (fields named warmup_*) set to `seconds`."""
    names = [f.name for f in fields(timing) if f.name.startswith("warmup_")]  # type: ignore[arg-type]
    return replace(timing, **{name: seconds for name in names})  # type: ignore[type-var]


def isolation_verdicts(
    rows: dict[str, dict[str, float]], contenders: dict[str, Any]
) -> dict[str, bool]:
    """Per service arm: whether it meets all three of issue 15's targets at once."""
    return {
        name: bool(
            row["p99_ratio"] <= ISOLATION_TTFT_RATIO
            and row["gap_p99_ratio"] <= ISOLATION_GAP_RATIO
            and row["throughput_vs_fifo"] >= TARGET_THROUGHPUT
        )
        for name, row in rows.items()
        if name in contenders
    }
