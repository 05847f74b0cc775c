"""A cut-short stream of a request admitted through the headroom: its late correction from
the engine's counters moves the tenant's tokens, not its fair share (the request was outside
it; tests/unit/test_sched_headroom_debt.py)."""

from __future__ import annotations

from extproc.admission import AdmissionController
from extproc.estimation import TokenEstimator
from extproc.metrics import Metrics
from extproc.scheduler import Ticket
from extproc.service.engine_metrics import EngineReading
from extproc.service.reconcile import EngineLedger
from extproc.service.request import Request, Settlement
from tests.unit.test_sched_headroom_debt import SOFT, headroom_scheduler

ENGINE = "127.0.0.1:8001"


def _reading(prompt: float, generation: float) -> EngineReading:
    return EngineReading(0.0, 0.0, 0.0, prompt, generation)


async def test_the_exemption_reaches_the_late_correction() -> None:
    sched = headroom_scheduler("drr")
    metrics = Metrics()
    admission = AdmissionController(sched, metrics)
    ledger = EngineLedger()
    ledger.track(ENGINE, "p")
    assert ledger.balance(ENGINE, _reading(1000, 5000)) == []  # the base
    settlement = Settlement(
        admission, sched, metrics, TokenEstimator(sched.policy.source.estimation), ledger
    )
    try:
        flood = [admission.submit(Ticket(f"f{i}", "flood", "p", 14, 64)) for i in range(20)]
        assert sum(turn.done() for turn in flood) == SOFT
        turn = admission.submit(Ticket("q", "quiet", "p", 14, 64))
        grant = turn.result()
        assert grant.fair_exempt  # the soft limit was full: it took the headroom
        request = Request(
            "q", 0.0, "/v1/completions", "quiet", "standard", "p", prompt_estimate=14,
            grant=grant, upstream=ENGINE,
        )  # fmt: skip
        settlement.settle(request, None, 10)  # the client left after 10 tokens
        assert request.usage_provisional
        level = sched.snapshot()["tenants"]["quiet"]["fair_share"]["p"]
        served = sched.snapshot()["tenants"]["quiet"]["served_tokens"]
        # The engine finished the prompt and generated 12 tokens before it saw the abort.
        [correction] = ledger.balance(ENGINE, _reading(1014, 5012))
        assert correction.item.fair_exempt
        settlement.apply_correction(correction)
        assert sched.snapshot()["tenants"]["quiet"]["served_tokens"] == served + 2
        assert sched.snapshot()["tenants"]["quiet"]["fair_share"]["p"] == level
    finally:
        await admission.close()
