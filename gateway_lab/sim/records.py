"""What the simulator records about each request: one mutable row, filled in as it goes."""

from __future__ import annotations

from dataclasses import dataclass

from extproc.types import Outcome


@dataclass(slots=True, eq=False)
class RequestRecord:
    """Times are simulated seconds. A field stays None until the request gets there."""

    index: int
    request_id: str
    tenant: str
    arrival: float
    input_tokens: int
    output_tokens: int
    """Tokens the engine will generate (the trace's output, capped by max_tokens)."""
    max_tokens: int
    """max_tokens the client asked for: the scheduler reserves it and routing counts it."""
    priority: int = 0
    """vLLM's request priority (lower first) the engine gets; see TraceRequest.priority."""
    hash_ids: tuple[int, ...] = ()
    """The prompt's prefix block ids (TraceRequest.hash_ids), keying the engine's cache."""
    tier: str | None = None
    pool: str | None = None
    outcome: Outcome | None = None
    detail: str = ""
    admitted_at: float | None = None
    lease_id: int | None = None
    replica: int | None = None
    engine_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    generated: int = 0
    charged: int = 0
    """Output tokens charged to the scheduler (one charge_output per generated token)."""
    preemptions: int = 0
    cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache (their prefill skipped)."""

    @property
    def completed(self) -> bool:
        return self.finished_at is not None

    @property
    def queue_wait(self) -> float | None:
        return None if self.admitted_at is None else self.admitted_at - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for single-token answers)."""
        if self.finished_at is None or self.first_token_at is None or self.generated < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.generated - 1)
