"""`Scheduler.queue_full_whatever_the_body`: the queue-full refusal the service gives at the
request headers (so a refused request sends no body and opens no accounting stream) is the
one `submit` gives, and only where no request of the tenant could go straight through."""

from __future__ import annotations

from extproc.policy import Policy, policy_from_text
from extproc.scheduler import ManualClock, Scheduler, Ticket
from extproc.types import Outcome

MAX_QUEUED = 2


def _policy(pools: str) -> Policy:
    return policy_from_text(f"""\
version: 1
tiers: [premium, standard]
tenants:
  flood: {{tier: standard, limits: {{max_queued: {MAX_QUEUED}}}}}
  quiet: {{tier: standard, limits: {{max_queued: {MAX_QUEUED}}}}}
  vip: {{tier: premium, limits: {{max_queued: {MAX_QUEUED}}}}}
pools:
{pools}""")


def _pool(name: str, port: int) -> str:
    return (
        f"  {name}: {{max_total_tokens: 100000, max_inflight: 1, max_inflight_tokens: 10000000,"
        f' endpoints: ["127.0.0.1:{port}"], headroom: 0, adaptive: {{enabled: false}}}}\n'
    )


def _flooded(policy: Policy, pool: str = "p") -> Scheduler:
    """The flooder holds the pool's one slot and has MAX_QUEUED requests queued for it."""
    sched = Scheduler(policy, ManualClock(10.0))
    assert sched.submit(Ticket("f-in", "flood", pool, 100, 100)) is None
    assert len(sched.dispatch()) == 1
    for i in range(MAX_QUEUED):
        assert sched.submit(Ticket(f"f{i}", "flood", pool, 100, 100)) is None
    assert sched.dispatch() == []
    return sched


def test_the_early_refusal_is_the_one_submit_gives() -> None:
    sched = _flooded(_policy(_pool("p", 1)))
    early = sched.queue_full_whatever_the_body("f-new", "flood", "chat")
    late = sched.submit(Ticket("f-new", "flood", "p", 100, 100))
    assert early is not None and late is not None
    assert early.outcome is Outcome.REJECTED_QUEUE_FULL and early.http_status == 429
    assert (early.retry_after_s, early.message, dict(early.headers)) == (
        late.retry_after_s, late.message, dict(late.headers),
    )  # fmt: skip
    assert early.retry_after_s is not None and early.retry_after_s >= 1


def test_below_max_queued_or_for_another_tenant_it_waits_for_the_body() -> None:
    sched = Scheduler(_policy(_pool("p", 1)), ManualClock(10.0))
    for i in range(MAX_QUEUED):  # one admitted, one queued: below max_queued
        assert sched.submit(Ticket(f"f{i}", "flood", "p", 100, 100)) is None
        sched.dispatch()
    assert sched.queue_full_whatever_the_body("f-new", "flood", "chat") is None
    flooded = _flooded(_policy(_pool("p", 1)))
    assert flooded.queue_full_whatever_the_body("q", "quiet", "chat") is None
    assert flooded.queue_full_whatever_the_body("x", "nobody", "chat") is None


def test_a_pool_nobody_of_its_tier_waits_for_leaves_it_to_the_body() -> None:
    # The flooder's queue is full for pool p, but a request sized for pool q might go
    # straight through: only the body says which pool it needs.
    sched = _flooded(_policy(_pool("p", 1) + _pool("q", 2)))
    assert sched.queue_full_whatever_the_body("f-new", "flood", "chat") is None
    assert sched.submit(Ticket("f-q", "flood", "q", 100, 100)) is None  # and it does
    assert [a.ticket.request_id for a in sched.dispatch()] == ["f-q"]


def test_a_pool_without_room_counts_as_one_it_cannot_go_through() -> None:
    policy = _policy(_pool("p", 1) + _pool("q", 2))
    sched = _flooded(policy)
    assert sched.submit(Ticket("other-q", "quiet", "q", 100, 100)) is None
    assert [a.ticket.request_id for a in sched.dispatch()] == ["other-q"]  # q is full now
    early = sched.queue_full_whatever_the_body("f-new", "flood", "chat")
    assert early is not None and early.outcome is Outcome.REJECTED_QUEUE_FULL
    assert sched.submit(Ticket("f-new", "flood", "q", 100, 100)) is not None  # as at the body


def test_only_its_tier_or_above_waiting_counts() -> None:
    # A premium tenant with a full queue in a pool where only standard tenants also wait
    # would go ahead of them (strict priority): its own band is what matters.
    sched = _flooded(_policy(_pool("p", 1)))
    for i in range(MAX_QUEUED):
        assert sched.submit(Ticket(f"v{i}", "vip", "p", 100, 100)) is None
    assert sched.queue_full_whatever_the_body("v-new", "vip", "chat") is not None
    sched.cancel("v0")
    sched.cancel("v1")
    # the flooder's queue is still full; vip has nothing queued
    assert sched.queue_full_whatever_the_body("f-new", "flood", "chat") is not None
    assert sched.queue_full_whatever_the_body("v-new", "vip", "chat") is None
