"""Service-level objectives a simulated request is judged by."""

from __future__ import annotations

from dataclasses import dataclass

from gateway_lab.sim.records import RequestRecord


@dataclass(frozen=True, slots=True)
class Slo:
    """A request meets the SLO when it completed and every objective set here holds.

    ttft_s + ttft_per_ktok_s * input_tokens / 1000 bounds the time to first token (the
    per-1k-token allowance lets long prompts take their prefill time); tpot_s bounds the mean
    time per output token after the first; e2e_s bounds arrival to last token. A request that
    was rejected, expired or shed misses every objective.
    """

    ttft_s: float | None = 2.0
    ttft_per_ktok_s: float = 0.0
    tpot_s: float | None = None
    e2e_s: float | None = None

    def ttft_limit(self, input_tokens: int) -> float | None:
        if self.ttft_s is None:
            return None
        return self.ttft_s + self.ttft_per_ktok_s * input_tokens / 1000.0

    def ttft_ok(self, record: RequestRecord) -> bool:
        limit = self.ttft_limit(record.input_tokens)
        ttft = record.ttft
        return record.completed and (limit is None or (ttft is not None and ttft <= limit))

    def tpot_ok(self, record: RequestRecord) -> bool:
        if not record.completed:
            return False
        tpot = record.tpot
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s

    def e2e_ok(self, record: RequestRecord) -> bool:
        e2e = record.e2e
        return e2e is not None and (self.e2e_s is None or e2e <= self.e2e_s)

    def met(self, record: RequestRecord) -> bool:
        return self.ttft_ok(record) and self.tpot_ok(record) and self.e2e_ok(record)

    def describe(self) -> dict[str, float | None]:
        return {
            "ttft_ms": None if self.ttft_s is None else self.ttft_s * 1000.0,
            "ttft_per_ktok_ms": self.ttft_per_ktok_s * 1000.0,
            "tpot_ms": None if self.tpot_s is None else self.tpot_s * 1000.0,
            "e2e_ms": None if self.e2e_s is None else self.e2e_s * 1000.0,
        }
