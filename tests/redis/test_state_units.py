"""Pure pieces of the shared state (no Redis needed): the scheduler hooks it uses, the local
fallback share, the capacity mirror and the limit-store facade."""

from __future__ import annotations

from extproc.policy.model import Pool
from extproc.scheduler import Bucket, ManualClock, Scheduler, Take, TakeResult
from extproc.state import SharedCapacity, SharedLimitStore, local_share
from extproc.state.ops import GiveBack, Op
from tests.unit.sched_support import make_policy, ticket


def scheduler(**pools: int) -> Scheduler:
    policy = make_policy(
        {
            "a": {"tier": "gold", "limits": {"max_concurrency": 2}},
            "b": {"tier": "gold"},
            "c": {"tier": "silver"},
        },
        pools={
            name: {"max_inflight": n, "max_inflight_tokens": 100_000} for name, n in pools.items()
        },
    )
    return Scheduler(policy, ManualClock())


def test_requeue_puts_a_tentative_admission_back_in_its_place() -> None:
    s = scheduler(p=1)
    first, second = ticket("a", request_id="a1"), ticket("a", request_id="a2")
    assert s.submit(first) is None and s.submit(second) is None
    (admitted,) = s.dispatch()
    assert admitted.ticket.request_id == "a1"
    before = s.snapshot()["tenants"]["a"]["fair_share"]["p"]
    assert s.requeue(admitted.lease.lease_id)
    snapshot = s.snapshot()
    assert snapshot["pools"]["p"]["inflight"] == 0 and snapshot["queued"] == 2
    assert snapshot["tenants"]["a"]["served_requests"] == 0
    assert snapshot["tenants"]["a"]["fair_share"]["p"] != before  # the charge was reversed
    (again,) = s.dispatch()
    assert again.ticket.request_id == "a1"  # it kept its place ahead of a2
    assert not s.requeue(12345)


def test_parked_tenants_do_not_compete_until_unparked() -> None:
    s = scheduler(p=1)
    s.submit(ticket("a", request_id="a1"))
    s.submit(ticket("b", request_id="b1"))
    (admitted,) = s.dispatch()
    assert s.requeue(admitted.lease.lease_id, park=True)
    parked_tenant = admitted.ticket.tenant
    assert ("p", parked_tenant) in s.parked()
    assert (("p", 0, parked_tenant)) not in s.backlogged()
    (other,) = s.dispatch()
    assert other.ticket.tenant != parked_tenant
    s.release(other.lease.lease_id)
    assert s.dispatch() == []  # the parked tenant waits although there is room
    assert sorted(s.queued_tenants("p")) == [parked_tenant]
    assert s.unpark(pool="p") == 1
    (last,) = s.dispatch()
    assert last.ticket.tenant == parked_tenant


def test_check_rejects_without_charging_and_rate_takes_lists_the_buckets() -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"requests_per_minute": 60, "tokens_per_minute": 600}}}
    )
    s = Scheduler(policy, ManualClock())
    assert s.check(ticket("nobody")) is not None
    assert s.check(ticket("a", input_tokens=10, max_output=20)) is None
    takes = s.rate_takes(ticket("a", input_tokens=10, max_output=20))
    assert [(t.bucket.key, t.cost) for t in takes] == [("a:requests", 1.0), ("a:tokens", 30.0)]
    assert s.snapshot()["tenants"]["a"]["buckets"] == {"requests": 60.0, "tokens": 600.0}


def test_local_share_divides_every_limit_by_the_replicas() -> None:
    policy = make_policy(
        {"a": {"tier": "gold", "limits": {"requests_per_minute": 25, "tokens_per_minute": 1000,
                                          "max_concurrency": 3}}},
        pools={"p": {"max_inflight": 10, "max_inflight_tokens": 5_000_000}},
    )  # fmt: skip
    share = local_share(policy, 4)
    limits = share.tenants["a"].limits
    assert (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrency) == (
        7, 250, 1,
    )  # fmt: skip
    assert share.pools["p"].max_inflight == 3
    # never below one request of the pool's largest size
    assert share.pools["p"].max_inflight_tokens == 1_250_000
    assert local_share(policy, 1) is policy


def pool(inflight: int = 4, tokens: int = 1000) -> Pool:
    return Pool(
        max_total_tokens=500, max_inflight=inflight, max_inflight_tokens=tokens, endpoints=["x:1"]
    )


def test_capacity_mirror_counts_other_processes_only_when_shared() -> None:
    capacity = SharedCapacity(pool())
    capacity.acquire(100)
    capacity.observe(total=4, total_tokens=400, confirmed=1, confirmed_tokens=100)
    assert capacity.inflight == 4 and not capacity.has_slot()
    capacity.set_shared(False)
    assert capacity.inflight == 1 and capacity.fits(800)
    capacity.set_shared(True)
    capacity.observe(total=1, total_tokens=100, confirmed=1, confirmed_tokens=100)
    assert capacity.fits(800)
    capacity.blocked = True
    assert not capacity.fits(1) and not capacity.has_slot() and not capacity.has_headroom()


def test_limit_store_facade_routes_by_mode_and_keeps_the_outage_debt() -> None:
    sent: list[Op] = []
    store = SharedLimitStore(sent.append)
    bucket = Bucket("a:tokens", 100.0, 1.0)
    prepared = TakeResult(True, (40.0,), 0.0)
    store.prepare(prepared)
    assert store.try_take([Take(bucket, 60.0)], 0.0) is prepared
    assert store.unused() is None
    store.give_back(bucket, 10.0, 0.0)
    assert sent and sent[-1] == GiveBack(bucket, 10.0)
    store.adjust(bucket, 5.0, 0.0)  # shared: settled by the release in Redis
    assert len(sent) == 1
    store.shared = False
    assert store.try_take([Take(bucket, 30.0)], 0.0).ok
    store.adjust(bucket, -10.0, 0.0)
    store.give_back(bucket, 5.0, 0.0)
    assert store.take_debt() == [(bucket, 15.0)]
    assert store.take_debt() == []
