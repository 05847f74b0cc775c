"""Reaching into the engine from the door: the engine priority each admission carries, and
prefill pacing of backlogged tenants (extproc/scheduler/dispatch.py, leases.py)."""

from __future__ import annotations

from extproc.policy import Policy, policy_from_text
from extproc.scheduler import Admission, ManualClock, Scheduler, Ticket


def _policy(pool_keys: str = "", max_inflight: int = 8) -> Policy:
    extra = f", {pool_keys}" if pool_keys else ""
    return policy_from_text(f"""\
version: 1
tiers: [gold, silver]
tenants:
  vip: {{tier: gold, limits: {{max_queued: 1000}}}}
  flood: {{tier: silver, limits: {{max_queued: 1000}}}}
  quiet: {{tier: silver, limits: {{max_queued: 1000}}}}
pools:
  p: {{max_total_tokens: 100000, max_inflight: {max_inflight}, max_inflight_tokens: 10000000,
       endpoints: ["127.0.0.1:1"], headroom: 0, adaptive: {{enabled: false}}{extra}}}
""")


def _ticket(rid: str, tenant: str, prompt: int = 100, streamed: bool = True) -> Ticket:
    return Ticket(rid, tenant, "p", prompt, 100, streamed=streamed)


def _submit(sched: Scheduler, *tickets: Ticket) -> None:
    for ticket in tickets:
        assert sched.submit(ticket) is None


def _by_id(admissions: list[Admission]) -> dict[str, Admission]:
    return {a.ticket.request_id: a for a in admissions}


def test_engine_priority_orders_tiers_strictly_then_light_before_backlogged() -> None:
    sched = Scheduler(_policy("prefill_budget_tokens: 0", max_inflight=4), ManualClock(0.0))
    _submit(sched, *(_ticket(f"f{i}", "flood") for i in range(10)))
    first = sched.dispatch()
    # silver is rank 1; the flooder wants far more than its share: backlogged
    assert [a.engine_priority for a in first] == [3, 3, 3, 3]
    sched.release(first[0].lease.lease_id)
    _submit(sched, _ticket("q0", "quiet"))
    (quiet,) = sched.dispatch()
    assert quiet.ticket.request_id == "q0" and quiet.engine_priority == 2  # silver, light
    sched.release(first[1].lease.lease_id)
    _submit(sched, *(_ticket(f"v{i}", "vip") for i in range(6)))
    (vip,) = sched.dispatch()
    # gold, and far beyond its share: backlogged, still ahead of every silver request
    assert vip.ticket.tenant == "vip" and vip.engine_priority == 1
    assert vip.engine_priority < quiet.engine_priority < first[0].engine_priority


def test_a_tenant_with_a_queue_at_the_door_is_not_light_whatever_its_share() -> None:
    """Two backlogged tenants: "quiet" asks for less work than its half (2 small requests
    against the flooder's 10 big ones), but while a second request of its own waits at the
    door it is backlogged too, and gets the backlogged engine priority; its last queued
    request is light again."""
    sched = Scheduler(_policy("prefill_budget_tokens: 0", max_inflight=2), ManualClock(0.0))
    _submit(sched, *(_ticket(f"f{i}", "flood", prompt=2000) for i in range(10)))
    first = sched.dispatch()
    _submit(sched, _ticket("q0", "quiet"), _ticket("q1", "quiet"))
    sched.release(first[0].lease.lease_id)
    (q0,) = sched.dispatch()
    assert q0.ticket.request_id == "q0" and q0.engine_priority == 3  # q1 still queued
    sched.release(first[1].lease.lease_id)
    admitted = _by_id(sched.dispatch())
    assert admitted["q1"].engine_priority == 2  # nothing of quiet's left at the door


def test_engine_priority_off_leaves_the_admission_without_one() -> None:
    sched = Scheduler(_policy("engine_priority: false"), ManualClock(0.0))
    _submit(sched, _ticket("f0", "flood"))
    (admission,) = sched.dispatch()
    assert admission.engine_priority is None


def test_prefill_budget_paces_backlogged_tenants_until_first_tokens() -> None:
    sched = Scheduler(_policy("prefill_budget_tokens: 250"), ManualClock(0.0))
    _submit(sched, *(_ticket(f"f{i}", "flood") for i in range(6)))
    flood = sched.dispatch()
    # 0, 100, 200 prefilling are below 250; at 300 the flooder waits with 5 slots still free
    assert [a.ticket.request_id for a in flood] == ["f0", "f1", "f2"]
    assert sched.snapshot()["pools"]["p"]["prefilling_tokens"] == 300
    _submit(sched, _ticket("q0", "quiet"))
    assert [a.ticket.request_id for a in sched.dispatch()] == ["q0"]  # light: not paced
    assert sched.first_token(flood[0].lease.lease_id)
    assert sched.dispatch() == []  # 300 (f1, f2, q0) still at or above the budget
    assert sched.first_token(flood[0].lease.lease_id)  # idempotent
    assert sched.snapshot()["pools"]["p"]["prefilling_tokens"] == 300
    sched.release(flood[1].lease.lease_id)  # a release ends its prefill too
    assert [a.ticket.request_id for a in sched.dispatch()] == ["f3"]
    assert sched.snapshot()["pools"]["p"]["prefilling_tokens"] == 300


def test_a_budget_of_one_lets_one_backlogged_prompt_prefill_at_a_time() -> None:
    """`prefill_budget_tokens: 1`, the point that holds kvwarden's workload: whatever the
    prompts' size, the next backlogged request goes in when no other prompt is in prefill,
    never two together (docs/benchmarks.md, "Paced at one prompt"); a light tenant's is not
    held but counts."""
    sched = Scheduler(_policy("prefill_budget_tokens: 1"), ManualClock(0.0))
    _submit(sched, *(_ticket(f"f{i}", "flood", prompt=5 + 40 * i) for i in range(4)))
    order = []
    for _ in range(4):
        (admission,) = sched.dispatch()
        order.append(admission.ticket.request_id)
        quiet = _ticket(f"q{len(order)}", "quiet", prompt=14)
        _submit(sched, quiet)
        (light,) = sched.dispatch()  # not paced
        assert light.ticket.request_id == quiet.request_id
        assert sched.first_token(admission.lease.lease_id)
        assert sched.dispatch() == []  # the quiet prompt is still in prefill
        assert sched.first_token(light.lease.lease_id)
    assert order == ["f0", "f1", "f2", "f3"]


def test_a_chunk_of_output_ends_the_prefill_as_a_first_token_does() -> None:
    sched = Scheduler(_policy("prefill_budget_tokens: 150"), ManualClock(0.0))
    _submit(sched, *(_ticket(f"f{i}", "flood") for i in range(3)))
    (f0, _f1) = sched.dispatch()
    sched.charge_output(f0.lease.lease_id, 1)
    assert sched.snapshot()["pools"]["p"]["prefilling_tokens"] == 100
    assert [a.ticket.request_id for a in sched.dispatch()] == ["f2"]


def test_non_streamed_requests_are_not_counted_as_prefilling() -> None:
    sched = Scheduler(_policy("prefill_budget_tokens: 150"), ManualClock(0.0))
    _submit(sched, *(_ticket(f"f{i}", "flood", streamed=False) for i in range(5)))
    assert len(sched.dispatch()) == 5
    assert sched.snapshot()["pools"]["p"]["prefilling_tokens"] == 0


def test_pacing_off_by_default_and_a_set_budget() -> None:
    for keys in ("", "prefill_budget_tokens: 0", "prefill_budget_tokens: false"):
        sched = Scheduler(_policy(keys), ManualClock(0.0))
        _submit(sched, *(_ticket(f"f{i}", "flood", prompt=50_000) for i in range(8)))
        assert len(sched.dispatch()) == 8
        assert sched.snapshot()["pools"]["p"]["prefill_budget_tokens"] is None
    paced = Scheduler(_policy("prefill_budget_tokens: 100000"), ManualClock(0.0))
    assert paced.snapshot()["pools"]["p"]["prefill_budget_tokens"] == 100_000
    _submit(paced, *(_ticket(f"f{i}", "flood", prompt=50_000) for i in range(8)))
    assert len(paced.dispatch()) == 2  # 0 and 50,000 are below 100,000


def test_requeue_gives_back_the_prefill_it_took() -> None:
    sched = Scheduler(_policy("prefill_budget_tokens: 150"), ManualClock(0.0))
    _submit(sched, *(_ticket(f"f{i}", "flood") for i in range(3)))
    (f0, _f1) = sched.dispatch()
    assert sched.requeue(f0.lease.lease_id)
    assert sched.snapshot()["pools"]["p"]["prefilling_tokens"] == 100
    assert [a.ticket.request_id for a in sched.dispatch()] == ["f0"]
