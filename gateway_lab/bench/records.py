"""What the load generator sends and records: request specs with prompts of an exact token
count, one record per request (with, where asked, the arrival of each output chunk), and
per-tenant token meters in time bins."""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway_lab.engine.tokens import MESSAGE_OVERHEAD_TOKENS

_WORDS: tuple[str, ...] = (
    "art", "bay", "cab", "dew", "elk", "fig", "gem", "hut", "ink", "jar",
    "kit", "lid", "mud", "nut", "oak", "pen", "quo", "rug", "sap", "tin",
    "urn", "van", "wax", "yak", "zip", "arc", "bee", "cod", "dye", "eel",
)  # fmt: skip


def prompt_text(tokens: int, rng: random.Random) -> str:
    """A chat message the emulated engine counts as exactly `tokens` prompt tokens
    (4 per message + one per 4 bytes: every word here is 4 bytes with its space)."""
    words = max(1, tokens - MESSAGE_OVERHEAD_TOKENS)
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return text + " "


def distinct_prompt(text: str, index: int) -> str:
    """`text` with its first three words replaced by a code for `index` (same byte length,
    so the same token count): prompts of different indexes (< 27,000) differ in their first
    KV block, so an engine's prefix cache finds nothing to reuse between them, and the load
    is the fresh prefill the benchmarks mean, on the emulator and on vLLM alike."""
    words = text.split(" ")
    n = len(_WORDS)
    for k in range(min(3, len(words) - 1)):
        words[k] = _WORDS[index // n**k % n]
    return " ".join(words)


@dataclass(frozen=True, slots=True)
class Spec:
    tenant: str
    key: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    headers: Mapping[str, str] = field(default_factory=dict)

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "model": "bench",
                "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )


class Chunks:
    """The output-carrying SSE chunks of one streamed response, in arrival order: each one's
    time (seconds since the run's start) and output tokens, in two compact arrays (12 bytes a
    chunk), so the quiet tenant's every inter-token gap can be measured."""

    __slots__ = ("times", "tokens")

    def __init__(self) -> None:
        self.times = array("d")
        self.tokens = array("I")

    def add(self, at: float, tokens: int) -> None:
        self.times.append(at)
        self.tokens.append(tokens)

    def gaps(self) -> list[float]:
        """Every inter-token gap (seconds). The first chunk ends the wait for the first token
        (the TTFT, never a gap; tokens that came with it are not gaps either); a later chunk of
        n tokens arriving t after the previous chunk is n gaps of t / n each (a client cannot
        tell when tokens that arrive together were made)."""
        gaps: list[float] = []
        times, tokens = self.times, self.tokens
        for i in range(1, len(times)):
            n = tokens[i]
            gaps.extend([(times[i] - times[i - 1]) / n] * n)
        return gaps


@dataclass(slots=True)
class Record:
    """One request, times in seconds since the run's start."""

    tenant: str
    start: float
    status: int
    ttft: float | None
    """First SSE data chunk after the start (None: none arrived)."""
    end: float
    prompt_tokens: int
    output_tokens: int
    queue_ms: float | None
    max_tokens: int = 0
    retry_after: float | None = None
    complete: bool = False
    """The response ended normally (not cut by the end of the run)."""
    censored: bool = False
    """Cut by the end of the run before its first token: `ttft` is a lower bound."""
    events: int = 0
    """SSE data events received (role, tokens, usage, [DONE]): the chunks a gateway relays."""
    chunks: Chunks | None = None
    """The output-carrying chunks, kept only for the tenants a `Load` was told to (its
    `gap_tenants`): a flooder's hundreds of streams need none."""

    def as_row(self) -> list[Any]:
        return [
            self.tenant,
            round(self.start, 4),
            self.status,
            None if self.ttft is None else round(self.ttft, 5),
            round(self.end, 4),
            self.prompt_tokens,
            self.output_tokens,
            self.queue_ms,
            self.max_tokens,
            self.complete,
            self.censored,
        ]


RECORD_COLUMNS = [
    "tenant", "start_s", "status", "ttft_s", "end_s", "prompt_tokens", "output_tokens",
    "queue_ms", "max_tokens", "complete", "censored",
]  # fmt: skip


class Meter:
    """Per tenant, in time bins: output tokens received and weighted service
    (input_weight * prompt tokens at the first token, output_weight per output token)."""

    def __init__(self, bin_s: float, input_weight: float = 1.0, output_weight: float = 2.0):
        self.bin_s = bin_s
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.tokens: dict[str, dict[int, float]] = {}
        self.service: dict[str, dict[int, float]] = {}

    def _add(
        self, table: dict[str, dict[int, float]], tenant: str, at: float, value: float
    ) -> None:
        bins = table.setdefault(tenant, {})
        index = int(at // self.bin_s)
        bins[index] = bins.get(index, 0.0) + value

    def first_token(self, tenant: str, at: float, prompt_tokens: int) -> None:
        self._add(self.service, tenant, at, self.input_weight * prompt_tokens)

    def output(self, tenant: str, at: float, tokens: int) -> None:
        self._add(self.tokens, tenant, at, float(tokens))
        self._add(self.service, tenant, at, self.output_weight * tokens)

    def total(self, tenant: str, start: float, end: float, *, service: bool = False) -> float:
        bins = (self.service if service else self.tokens).get(tenant, {})
        first, last = int(start // self.bin_s), math.ceil(end / self.bin_s)
        return sum(v for i, v in bins.items() if first <= i < last)

    def rate(self, tenant: str, start: float, end: float, *, service: bool = False) -> float:
        return self.total(tenant, start, end, service=service) / max(1e-9, end - start)

    def series(self, tenant: str, end: float, *, service: bool = False) -> list[float]:
        """Per-bin values from 0 to `end` (for plots and the JSON)."""
        bins = (self.service if service else self.tokens).get(tenant, {})
        return [round(bins.get(i, 0.0), 2) for i in range(math.ceil(end / self.bin_s))]

    def tenants(self) -> list[str]:
        return sorted(set(self.tokens) | set(self.service))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]
