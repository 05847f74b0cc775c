"""The δ guarantee (extproc/scheduler/latency.py): the alone model, each tenant's δ, and the
controller that a tier's latency_delta drives."""

from __future__ import annotations

import math
import random

import pytest

from extproc.metrics import Metrics
from extproc.policy import PolicyError, policy_from_text
from extproc.scheduler import Admission, ManualClock, Scheduler, Ticket
from extproc.scheduler.latency import (
    COOLDOWN_S,
    DECREASE,
    MIN_FACTOR,
    PACING_EXPONENT,
    QUANTILE_GAIN,
    DeltaController,
)


def _scheduler(objective: str = "100ms") -> tuple[Scheduler, ManualClock]:
    options = f"tier_options: {{standard: {{latency_delta: {objective}}}}}\n" if objective else ""
    policy = policy_from_text(f"""\
version: 1
tiers: [standard]
{options}tenants:
  flood: {{tier: standard, limits: {{max_queued: 1000}}}}
  quiet: {{tier: standard, limits: {{max_queued: 1000}}}}
  solo: {{tier: standard}}
pools:
  p: {{max_total_tokens: 100000, max_inflight: 8, max_inflight_tokens: 10000000,
       endpoints: ["127.0.0.1:1"], headroom: 2, adaptive: {{enabled: false}},
       prefill_budget_tokens: 0}}
""")
    clock = ManualClock(0.0)
    return Scheduler(policy, clock), clock


def _one(sched: Scheduler, rid: str, tenant: str) -> Admission:
    assert sched.submit(Ticket(rid, tenant, "p", 100, 100)) is None
    (admission,) = sched.dispatch()
    return admission


def _learn_alone(sched: Scheduler, clock: ManualClock, ttft: float = 0.05) -> None:
    for i in range(3):
        admission = _one(sched, f"alone{i}", "solo")
        clock.advance(ttft)
        sched.first_token(admission.lease.lease_id)
        sched.release(admission.lease.lease_id)


def test_ttft_delta_is_published_and_a_violation_tightens_the_backlogged_share() -> None:
    sched, clock = _scheduler()
    _learn_alone(sched, clock)
    assert sched.snapshot()["pools"]["p"]["alone"]["ttft_samples"] == 3
    for i in range(20):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    flood = sched.dispatch()
    assert len(flood) == 6  # the soft limit
    quiet = _one(sched, "q", "quiet")  # light: through the headroom
    clock.advance(0.3)
    sched.first_token(quiet.lease.lease_id)
    snapshot = sched.snapshot()
    assert snapshot["tenants"]["quiet"]["latency_delta"]["ttft"]["mean_s"] == pytest.approx(0.25)
    assert snapshot["tenants"]["flood"]["latency_delta"] is None  # no first token yet
    pool = snapshot["pools"]["p"]
    assert pool["delta_factor"] == pytest.approx(DECREASE) and pool["delta_violations"] == 1
    # backlogged requests now go only below 0.7 x the soft limit of 6: 4 in flight (and
    # once their prompts have prefilled: the next test)
    for admission in flood[:3]:
        sched.release(admission.lease.lease_id)
    for admission in flood[3:]:
        sched.first_token(admission.lease.lease_id)
    assert sched.dispatch() == []  # 3 flood + quiet = 4
    sched.release(flood[3].lease.lease_id)
    assert [a.ticket.tenant for a in sched.dispatch()] == ["flood"]
    assert sched.dispatch() == []


def test_a_cut_pool_without_a_prefill_budget_paces_the_backlogged_prompts() -> None:
    """Below f = 1 the backlogged tenants' prompts prefilling at once are held to f ** 4 of the
    soft limit: the flood's queued requests no longer reach the engine together."""
    sched, clock = _scheduler()
    _learn_alone(sched, clock)
    for i in range(40):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    flood = sched.dispatch()
    assert len(flood) == 6  # uncut: six prompts prefill together
    pool = sched.snapshot()["pools"]["p"]
    assert pool["prefilling_requests"] == 6 and pool["prefilling_limit"] is None
    quiet = _one(sched, "q", "quiet")
    clock.advance(0.3)
    sched.first_token(quiet.lease.lease_id)  # late: one cut, f = 0.7
    sched.release(quiet.lease.lease_id)
    for admission in flood:
        sched.first_token(admission.lease.lease_id)
        sched.release(admission.lease.lease_id)
    assert PACING_EXPONENT == 4 and int(6 * DECREASE**4) == 1
    pool = sched.snapshot()["pools"]["p"]
    assert pool["prefilling_requests"] == 0 and pool["prefilling_limit"] == 1
    # the in-flight share (4 of 6) would let four go at once; one prompt at a time does
    admitted = []
    for _ in range(4):
        (admission,) = sched.dispatch()
        assert admission.ticket.tenant == "flood" and sched.dispatch() == []
        admitted.append(admission)
        sched.first_token(admission.lease.lease_id)  # its prompt prefilled: the next goes
    assert sched.dispatch() == []  # now the in-flight share binds: 4 in flight
    # slack opens the factor up again (0.1 per half second); at 1 the pacing goes with the cut
    for step in range(4):
        clock.advance(0.45)
        assert sched.submit(Ticket(f"slack{step}", "quiet", "p", 100, 100)) is None
        batch = sched.dispatch()
        admitted += [a for a in batch if a.ticket.tenant == "flood"]
        (quiet,) = [a for a in batch if a.ticket.tenant == "quiet"]
        clock.advance(0.05)
        sched.first_token(quiet.lease.lease_id)
        sched.release(quiet.lease.lease_id)
    pool = sched.snapshot()["pools"]["p"]
    assert pool["delta_factor"] == 1.0 and pool["prefilling_limit"] is None
    for admission in admitted:
        sched.release(admission.lease.lease_id)
    assert len(sched.dispatch()) == 6  # the soft limit, six prompts at once again


def test_a_backlogged_tenants_own_lag_does_not_steer() -> None:
    sched, clock = _scheduler()
    _learn_alone(sched, clock)
    for i in range(20):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    flood = sched.dispatch()
    clock.advance(2.0)
    sched.first_token(flood[-1].lease.lease_id)
    snapshot = sched.snapshot()
    assert snapshot["tenants"]["flood"]["latency_delta"]["ttft"]["samples"] == 1
    assert snapshot["pools"]["p"]["delta_factor"] == 1.0


def test_without_an_objective_delta_is_measured_but_nothing_steers() -> None:
    sched, clock = _scheduler(objective="")
    _learn_alone(sched, clock)
    for i in range(20):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    sched.dispatch()
    quiet = _one(sched, "q", "quiet")
    clock.advance(1.0)
    sched.first_token(quiet.lease.lease_id)
    snapshot = sched.snapshot()
    assert snapshot["tenants"]["quiet"]["latency_delta"]["ttft"]["mean_s"] == pytest.approx(0.95)
    assert snapshot["pools"]["p"]["delta_factor"] == 1.0


def test_token_delta_from_the_alone_step() -> None:
    sched, clock = _scheduler()
    lone = _one(sched, "lone", "quiet")
    for _ in range(5):  # the first chunk starts the clock; 4 gaps of 20 ms at batch 1
        clock.advance(0.02)
        sched.charge_output(lone.lease.lease_id, 1)
    alone = sched.snapshot()["pools"]["p"]["alone"]
    assert alone["step_samples"] == 4 and alone["step_s"] == pytest.approx(0.02)
    clock.advance(0.06)
    sched.charge_output(lone.lease.lease_id, 2)  # 30 ms per token: 10 ms later than alone
    tokens = sched.snapshot()["tenants"]["quiet"]["latency_delta"]["tokens"]
    assert tokens["peak_s"] == pytest.approx(0.01)
    assert tokens["samples"] == 2  # the gaps after the alone step had 3 samples


def test_a_batch_of_chunks_is_judged_by_its_longest_gap() -> None:
    """Counting in Envoy, 16 tokens arrive in one call with the longest gap between their
    chunks: the token δ is that gap's, while the alone step learns from the mean."""
    sched, clock = _scheduler()
    lone = _one(sched, "lone", "quiet")
    for _ in range(5):
        clock.advance(0.02)
        sched.charge_output(lone.lease.lease_id, 1)
    clock.advance(0.32)  # 16 tokens at a mean of 20 ms, one gap of them 70 ms
    sched.charge_output(lone.lease.lease_id, 16, largest_gap=0.07)
    snapshot = sched.snapshot()
    tokens = snapshot["tenants"]["quiet"]["latency_delta"]["tokens"]
    assert tokens["peak_s"] == pytest.approx(0.05)
    assert snapshot["pools"]["p"]["alone"]["step_s"] == pytest.approx(0.02)


def test_the_controller_cuts_once_per_cooldown_and_opens_with_slack() -> None:
    control = DeltaController()
    control.observe(0.5, 0.1, 10.0)
    control.observe(0.5, 0.1, 10.0 + COOLDOWN_S / 2)
    assert control.factor == pytest.approx(DECREASE) and control.violations == 2
    control.observe(0.5, 0.1, 10.0 + COOLDOWN_S)
    assert control.factor == pytest.approx(DECREASE**2)
    before = control.factor
    control.observe(0.01, 0.1, 11.0)  # slack: raised by the time since the last sample
    assert control.factor > before
    for step in range(100):
        control.observe(0.01, 0.1, 12.0 + step * 0.5)
    assert control.factor == 1.0 and control.limit(24) == 24
    control.factor = 0.01
    assert control.limit(24) == 1  # one backlogged request can always go


def test_delta_and_pacing_are_exported_as_metrics() -> None:
    sched, clock = _scheduler()
    _learn_alone(sched, clock)
    for i in range(20):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    sched.dispatch()
    quiet = _one(sched, "q", "quiet")
    clock.advance(0.3)
    sched.first_token(quiet.lease.lease_id)
    metrics = Metrics()
    metrics.refresh(sched.snapshot(), {"flood", "quiet", "solo"})
    sample = metrics.registry.get_sample_value
    labels = {"tenant": "quiet", "kind": "ttft"}
    assert sample("extproc_tenant_latency_delta_seconds", labels) == pytest.approx(0.25)
    assert sample("extproc_pool_delta_factor", {"pool": "p"}) == pytest.approx(DECREASE)
    # the six flooder requests dispatched have not shown a first token: 600 prompt tokens
    assert sample("extproc_pool_prefilling_tokens", {"pool": "p"}) == 600


def test_a_tightened_pool_keeps_the_quiet_tenant_light() -> None:
    """Throttling the backlogged tenants shrinks the pool's admitted work; the quiet tenant's
    share is of the whole demand, queued work included, so it stays light and is not held."""
    sched, clock = _scheduler()
    _learn_alone(sched, clock)
    for i in range(40):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    flood = sched.dispatch()
    for step in range(12):  # repeated violations, one cut per cooldown
        quiet = _one(sched, f"q{step}", "quiet")
        clock.advance(COOLDOWN_S)
        sched.first_token(quiet.lease.lease_id)
        sched.release(quiet.lease.lease_id)
    assert sched.snapshot()["pools"]["p"]["delta_factor"] == pytest.approx(MIN_FACTOR)
    for admission in flood:
        sched.release(admission.lease.lease_id)
    flood = sched.dispatch()
    assert len(flood) == 1  # the flooder: one request at the floor
    for i in range(3):
        assert sched.submit(Ticket(f"quiet{i}", "quiet", "p", 100, 100)) is None
    assert [a.ticket.tenant for a in sched.dispatch()] == ["quiet"] * 3


def _learn_alone_step(sched: Scheduler, clock: ManualClock, step: float = 0.02) -> None:
    lone = _one(sched, "lone", "solo")
    for _ in range(5):  # the first chunk starts the clock; 4 gaps at batch 1
        clock.advance(step)
        sched.charge_output(lone.lease.lease_id, 1)
    sched.release(lone.lease.lease_id)


def _quiet_beside_a_flood(
    sched: Scheduler, clock: ManualClock, ttft: float, gap: float, gaps: int = 3
) -> dict[str, float]:
    """A light request beside six flooder ones: its first token after `ttft`, then `gaps`
    tokens `gap` apart; the pool's controller state after it."""
    _learn_alone(sched, clock)  # TTFT 50 ms alone
    _learn_alone_step(sched, clock)  # 20 ms per token alone
    for i in range(20):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    assert len(sched.dispatch()) == 6
    quiet = _one(sched, "q", "quiet")
    clock.advance(ttft)
    sched.charge_output(quiet.lease.lease_id, 1)
    for _ in range(gaps):
        clock.advance(gap)
        sched.charge_output(quiet.lease.lease_id, 1)
    pool = sched.snapshot()["pools"]["p"]
    return {"factor": pool["delta_factor"], "violations": pool["delta_violations"]}


@pytest.mark.parametrize(
    ("objective", "steered"),
    [("100ms", True), ("{every_token: 100ms}", True), ("{token_gap: 50ms}", True),
     ("{first_token: 100ms}", False)],
)  # fmt: skip
def test_a_first_token_objective_lets_a_slow_stream_be(objective: str, steered: bool) -> None:
    """On time first token, then 200 ms per token against 20 ms alone: only the objectives
    that watch later tokens tighten the backlogged share."""
    sched, clock = _scheduler(objective)
    state = _quiet_beside_a_flood(sched, clock, ttft=0.05, gap=0.2)
    if steered:
        assert state["violations"] >= 1 and state["factor"] <= DECREASE
    else:
        assert state == {"factor": 1.0, "violations": 0}


@pytest.mark.parametrize(
    ("objective", "steered"),
    [("100ms", True), ("{first_token: 100ms}", True), ("{token_gap: 50ms}", False)],
)
def test_a_token_gap_objective_lets_a_late_first_token_be(objective: str, steered: bool) -> None:
    """The first token 950 ms late, then tokens at the alone step: the gap objective sees no
    violation, the first-token and the default (first and every token) objectives do."""
    sched, clock = _scheduler(objective)
    state = _quiet_beside_a_flood(sched, clock, ttft=1.0, gap=0.02)
    if steered:
        assert state["violations"] >= 1 and state["factor"] <= DECREASE
    else:
        assert state == {"factor": 1.0, "violations": 0}


@pytest.mark.parametrize(
    ("objective", "ttft", "gap", "steered"),
    [
        ("{first_token: 3x}", 0.12, 0.02, False),  # 77.5 ms late: within 2 x 42.5 ms alone
        ("{first_token: 3x}", 0.14, 0.02, True),  # 97.5 ms late
        ("{first_token: 2x}", 0.12, 0.02, True),  # beyond 1 x 42.5 ms
        ("{token_gap: 2x}", 0.05, 0.035, False),  # 15 ms per gap: within 1 x 20 ms alone
        ("{token_gap: 2x}", 0.05, 0.045, True),
        ("2x", 0.07, 0.02, False),  # every token within twice its alone time
        ("2x", 0.07, 0.06, True),  # the 4th token at 250 ms: 147.5 ms late, 102.5 ms alone
    ],
)
def test_an_objective_relative_to_alone_scales_with_the_alone_time(
    objective: str, ttft: float, gap: float, steered: bool
) -> None:
    """`Nx`: a token may take N times its alone time. Alone: 20 ms per token, and a TTFT of
    42.5 ms (three 50 ms first tokens and the 20 ms one of the request the step came from)."""
    sched, clock = _scheduler(objective)
    state = _quiet_beside_a_flood(sched, clock, ttft=ttft, gap=gap)
    if steered:
        assert state["violations"] >= 1 and state["factor"] <= DECREASE
    else:
        assert state == {"factor": 1.0, "violations": 0}


def test_one_duration_watches_the_first_token_and_every_token() -> None:
    sched, _ = _scheduler("150ms")
    delta = sched.policy.source.tier_options["standard"].latency_delta
    assert delta is not None
    assert (delta.first_token, delta.every_token, delta.token_gap) == (0.15, 0.15, None)


DELTA = "tier_options.standard.latency_delta"


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        ("0s", DELTA, "above 0"),
        ("-1s", DELTA, "invalid objective"),
        ("soon", DELTA, "use a duration (30ms) or a multiple of alone (2x)"),
        ("true", DELTA, "invalid objective"),
        ("1x", DELTA, "above 1x"),
        ("{}", DELTA, "set at least one of first_token"),
        ("{first_token: 0s}", f"{DELTA}.first_token", "above 0"),
        ("{first_token: 0.5x}", f"{DELTA}.first_token", "above 1x"),
        ("{token_gap: soon}", f"{DELTA}.token_gap", "invalid"),
        ("{ttft: 100ms}", f"{DELTA}.ttft", "unknown key"),
        ("{quantile: 0.99}", DELTA, "set at least one of first_token"),
        ("{token_gap: 20ms, quantile: 1.0}", f"{DELTA}.quantile", "less than or equal"),
        ("{token_gap: 20ms, quantile: 0.3}", f"{DELTA}.quantile", "greater than or equal"),
        ("{token_gap: 20ms, quantile: high}", f"{DELTA}.quantile", "valid number"),
    ],
)
def test_latency_delta_is_strict_with_file_line(value: str, field: str, message: str) -> None:
    text = f"""\
version: 1
tiers: [standard]
tier_options:
  standard: {{latency_delta: {value}}}
tenants: {{a: {{tier: standard}}}}
pools:
  p: {{max_total_tokens: 100, max_inflight: 4, max_inflight_tokens: 1000, endpoints: ["h:1"]}}
"""
    with pytest.raises(PolicyError) as caught:
        policy_from_text(text, "p.yaml")
    issues = [str(issue) for issue in caught.value.issues]
    assert any(i.startswith(f"p.yaml:4: {field}:") and message in i for i in issues), issues


def test_the_quantile_rule_moves_once_per_window_by_its_share_of_late_samples() -> None:
    """At q = 0.9 a window of late samples costs what nine windows without one give back,
    however many samples each holds; f stays within [MIN_FACTOR, 1]."""
    control = DeltaController()
    for _ in range(3):
        control.observe(0.2, 0.1, 1.0, quantile=0.9)
    assert control.factor == 1.0 and control.violations == 3  # the window is still open
    control.observe(
        0.09, 0.1, 1.0 + COOLDOWN_S, quantile=0.9
    )  # closes it; just below: no dead band
    assert control.factor == pytest.approx(math.exp(-0.9 * QUANTILE_GAIN))
    for window in range(1, 10):
        for _ in range(window):  # a window's weight does not depend on its samples
            control.observe(0.01, 0.1, 1.0 + (window + 1) * COOLDOWN_S, quantile=0.9)
    assert control.factor == pytest.approx(1.0)
    control.observe(0.01, 0.1, 100.0, quantile=0.9)
    assert control.factor == 1.0
    for window in range(100):
        control.observe(1.0, 0.1, 200.0 + window * COOLDOWN_S, quantile=0.9)
    assert control.factor == pytest.approx(MIN_FACTOR)


def _violating_share(quantile: float | None, shape: float, per_s: int, samples: int) -> float:
    """Feed the controller `per_s` samples a second whose chance of exceeding the objective is
    f ** shape (more of the pool to the backlogged tenants, more late tokens); the share of
    the second half's samples above the objective."""
    control, chance = DeltaController(), random.Random(15)
    late = 0
    for i in range(samples):
        violated = chance.random() < control.factor**shape
        control.observe(0.2 if violated else 0.01, 0.1, i / per_s, quantile)
        if i >= samples // 2:
            late += violated
    return late / (samples - samples // 2)


@pytest.mark.parametrize("shape", [2.0, 3.0])
@pytest.mark.parametrize("per_s", [1, 10])
def test_the_quantile_rule_settles_where_one_minus_q_of_the_samples_exceed(
    shape: float, per_s: int
) -> None:
    """What a P90 or P99 objective means: the long-run share of samples above it, at one
    sample a second or ten. The AIMD rule (no quantile) settles far above either at one a
    second (and its share depends on the rate)."""
    assert _violating_share(0.9, shape, per_s, 40_000) == pytest.approx(0.10, abs=0.02)
    assert _violating_share(0.99, shape, per_s, 40_000) == pytest.approx(0.01, abs=0.004)
    if per_s == 1:
        assert _violating_share(None, shape, per_s, 40_000) > 0.25


def test_a_tiers_quantile_reaches_the_pools_controller() -> None:
    """Five gaps of 200 ms per token against 20 ms alone, at P90: the first three fill a
    window, the fifth closes it, and f moves once by the window's share of late samples."""
    sched, clock = _scheduler("{token_gap: 50ms, quantile: 0.9}")
    state = _quiet_beside_a_flood(sched, clock, ttft=0.05, gap=0.2, gaps=5)
    assert state["violations"] == 5
    assert state["factor"] == pytest.approx(math.exp(-0.9 * QUANTILE_GAIN))


def test_a_gap_or_a_first_token_beside_another_prefill_is_not_alone() -> None:
    """With the controller at its floor a pool holds a quiet request and one backlogged one:
    few enough to count as nearly alone, but the other's prefill steps are not what the quiet
    request would get alone, so neither its TTFT nor its gaps teach the alone model then."""
    sched, clock = _scheduler()
    quiet = _one(sched, "q", "solo")  # admitted into an idle pool: an alone candidate
    other = _one(sched, "o", "flood")  # prefilling beside it
    clock.advance(0.3)
    sched.charge_output(quiet.lease.lease_id, 1)  # first token while the other prefills
    for _ in range(3):
        clock.advance(0.1)
        sched.charge_output(quiet.lease.lease_id, 1)
    alone = sched.snapshot()["pools"]["p"]["alone"]
    assert (alone["ttft_samples"], alone["step_samples"]) == (0, 0)
    sched.first_token(other.lease.lease_id)  # its prefill is over: decodes only now
    for _ in range(3):
        clock.advance(0.02)
        sched.charge_output(quiet.lease.lease_id, 1)
    alone = sched.snapshot()["pools"]["p"]["alone"]
    assert alone["step_samples"] == 3 and alone["step_s"] == pytest.approx(0.02)


def test_a_first_token_told_late_is_timed_when_it_passed() -> None:
    """With counting in Envoy, a short response's end may overtake its first-token call; the
    end then says how long ago the first chunk passed, and the δ sample is timed from then."""

    def quiet_ttft_delta(told_at: float, ago: float) -> float:
        sched, clock = _scheduler()
        _learn_alone(sched, clock)
        quiet = _one(sched, "q", "quiet")
        clock.advance(told_at)
        sched.first_token(quiet.lease.lease_id, ago=ago)
        mean: float = sched.snapshot()["tenants"]["quiet"]["latency_delta"]["ttft"]["mean_s"]
        return mean

    on_time = quiet_ttft_delta(0.1, 0.0)
    assert quiet_ttft_delta(0.3, 0.2) == pytest.approx(on_time)
    assert quiet_ttft_delta(0.3, 0.0) > on_time + 0.15  # told late without its time
    assert quiet_ttft_delta(0.1, -5.0) == pytest.approx(on_time)  # never later than now


def test_a_request_that_waited_at_the_door_teaches_alone_its_time_from_admission() -> None:
    """A backlogged request held at the door for seconds, then admitted into an idle pool, is
    an alone sample of the engine's part only: timed from its submit it taught the model
    seconds of "alone", every later lag came out negative and the controller never cut again
    (the kvwarden-workload sweep of extproc bench frontier, first-token objectives)."""
    sched, clock = _scheduler()
    _learn_alone(sched, clock)
    for i in range(7):
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
    flood = sched.dispatch()
    assert len(flood) == 6  # the seventh waits at the door
    clock.advance(2.0)
    for admission in flood:
        sched.first_token(admission.lease.lease_id)
        sched.release(admission.lease.lease_id)
    (waited,) = sched.dispatch()  # into an idle pool: an alone candidate
    clock.advance(0.05)
    sched.first_token(waited.lease.lease_id)
    sched.release(waited.lease.lease_id)
    assert sched.snapshot()["pools"]["p"]["alone"]["ttft_samples"] == 4
    quiet = _one(sched, "q", "quiet")
    clock.advance(0.3)
    sched.first_token(quiet.lease.lease_id)
    snapshot = sched.snapshot()
    assert snapshot["tenants"]["quiet"]["latency_delta"]["ttft"]["mean_s"] == pytest.approx(0.25)
