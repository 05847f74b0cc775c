"""The figures this service reads from a vLLM engine's Prometheus `/metrics` page (pure).

Gauges are summed over label sets (a server with several engine cores), except KV-cache usage,
of which the largest is taken (vLLM V1 names it `vllm:kv_cache_usage_perc`, older servers
`vllm:gpu_cache_usage_perc`). `extproc.service.engine_poller` fetches the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
_WANTED = (
    WAITING, RUNNING, *KV_USAGE, PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineReading:
    """The figures of one engine's /metrics page this service uses."""

    waiting: float
    running: float
    kv_usage: float
    prompt_tokens: float = 0.0
    """Counter: prompt tokens of every request the engine prefilled (aborted ones too)."""
    generation_tokens: float = 0.0
    """Counter: every token the engine generated (aborted requests' too)."""
    prefix_queries: float | None = None
    """Counter: prompt tokens looked up in the prefix cache (None: the engine has no cache
    metrics, e.g. prefix caching off)."""
    prefix_hits: float | None = None
    """Counter: of those, tokens found cached."""

    @property
    def idle(self) -> bool:
        return self.waiting == 0 and self.running == 0


def parse_engine_metrics(text: str) -> EngineReading | None:
    """Read the gauges from a Prometheus text page (summed over label sets); None if the
    page has none of them (not a vLLM engine)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        name = line[:name_end]
        if name not in _WANTED:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1 :]
        parts = rest.split()
        try:
            value = float(parts[0])
        except (ValueError, IndexError):
            continue
        if name in KV_USAGE:
            values[name] = max(values.get(name, 0.0), value)
        else:
            values[name] = values.get(name, 0.0) + value
    if not any(name in values for name in _WANTED):
        return None
    kv = next((values[name] for name in KV_USAGE if name in values), 0.0)
    return EngineReading(
        values.get(WAITING, 0.0),
        values.get(RUNNING, 0.0),
        kv,
        values.get(PROMPT_TOKENS, 0.0),
        values.get(GENERATION_TOKENS, 0.0),
        values.get(PREFIX_QUERIES),
        values.get(PREFIX_HITS),
    )
