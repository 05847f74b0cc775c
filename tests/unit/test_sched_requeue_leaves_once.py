"""A request the shared gate refused goes back to its queue (`Scheduler.requeue`) and must
leave it exactly once, whichever way it leaves: its queue-wait expiry, its deadline, overload
shedding or a cancel. Requeueing adds a second reference to the entry in its tenant's arrival
order and a second timer; neither may make it leave twice (seen in a four-process Redis test:
a pool's queued-budget count went missing, then "empty tenant queue" for a band member)."""

from __future__ import annotations

from extproc.scheduler import Scheduler
from tests.unit.sched_support import make_policy, scheduler, submit_ok, ticket


def requeued(wait: str = "10s") -> tuple[Scheduler, object]:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"max_queue_wait": wait}}, "b": {"tier": "gold"}},
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 100_000}},
    )
    sched, clock = scheduler(policy)
    submit_ok(sched, ticket("a", request_id="a1"))
    submit_ok(sched, ticket("a", request_id="a2", deadline=clock.now() + 5))
    (admitted,) = sched.dispatch()
    assert sched.requeue(admitted.lease.lease_id)  # the gate said no: back in its place
    (again,) = sched.dispatch()
    assert sched.requeue(again.lease.lease_id)  # twice, as a busy pool may
    return sched, clock


def consistent(sched: Scheduler) -> None:
    snapshot = sched.snapshot()
    assert snapshot["queued"] == 0
    assert snapshot["tenants"]["a"]["queued"] == 0
    # The pool's bookkeeping is whole again: new requests queue, dispatch and cancel.
    submit_ok(sched, ticket("a", request_id="later", max_output=9))
    assert sched.cancel("later")
    submit_ok(sched, ticket("b", request_id="b1"))
    (only,) = sched.dispatch()
    assert only.ticket.request_id == "b1"


def test_a_requeued_request_expires_once() -> None:
    sched, clock = requeued()
    clock.advance(11)
    rejected = sched.poll()
    assert sorted(r.request_id for r in rejected) == ["a1", "a2"]
    consistent(sched)


def test_a_requeued_request_passes_its_deadline_once() -> None:
    sched, clock = requeued(wait="60s")
    clock.advance(6)
    rejected = sched.poll()
    assert [r.request_id for r in rejected] == ["a2"]
    assert sched.cancel("a1")
    consistent(sched)


def test_shedding_answers_a_requeued_request_once() -> None:
    sched, _ = requeued()
    rejected = sched.shed_queued_of({"a"}, "behind")
    assert sorted(r.request_id for r in rejected) == ["a1", "a2"]
    consistent(sched)
