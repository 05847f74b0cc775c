"""The counts kept incrementally for cheap estimates stay equal to what they count, whatever
happens: each band's `queued` is its members' queued requests for the pool. Reads the
scheduler's live state directly: there is no public view of these counts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy import Policy
from extproc.scheduler import Scheduler
from tests.unit.sched_support import make_policy, scheduler, ticket

_TENANTS = ("a", "b", "c")
_POOLS = {
    "p": {"max_inflight": 2, "max_inflight_tokens": 100_000},
    "q": {"max_inflight": 1, "max_inflight_tokens": 100_000},
}


def _policy(c_gold: bool, *, reorder: bool = False, concurrency: int = 2) -> Policy:
    """`c_gold` moves one tenant between tiers; `reorder` changes the tier list (which
    restarts every band)."""
    tiers = ("silver", "gold") if reorder else ("gold", "silver")
    limits = {"max_concurrency": concurrency, "max_queued": 50}
    return make_policy(
        {
            "a": {"tier": "gold", "weight": 1, "limits": limits},
            "b": {"tier": "silver", "weight": 2, "limits": limits},
            "c": {"tier": "gold" if c_gold else "silver", "weight": 1, "limits": limits},
        },
        tiers=tiers,
        pools=_POOLS,
    )


def _check_counts(sched: Scheduler) -> None:
    live = sched._live
    for pool in live.pools.values():
        for band in pool.bands:
            members = sum(live.tenants[name].queues[pool.name].live for name in band.members)
            assert band.queued == members, (pool.name, band.tier)


_KINDS = (
    "submit",
    "submit",
    "dispatch",
    "release",
    "cancel",
    "park",
    "unpark",
    "requeue",
    "policy",
)
_ops = st.lists(
    st.tuples(
        st.sampled_from(_KINDS),
        st.sampled_from(_TENANTS),
        st.sampled_from(sorted(_POOLS)),
        st.integers(min_value=0, max_value=30),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops)
def test_band_queued_counts_follow_every_change(ops: list[tuple[str, str, str, int]]) -> None:
    sched, clock = scheduler(_policy(False))
    leases: list[int] = []
    ids: list[str] = []
    swapped = False
    for kind, tenant, pool, number in ops:
        clock.advance(0.1)
        if kind == "submit":
            made = ticket(tenant, pool=pool, input_tokens=10 + number, max_output=20)
            if sched.submit(made) is None:
                ids.append(made.request_id)
        elif kind == "dispatch":
            leases.extend(a.lease.lease_id for a in sched.dispatch())
        elif kind == "release" and leases:
            sched.release(leases.pop(number % len(leases)), number, number)
        elif kind == "cancel" and ids:
            sched.cancel(ids[number % len(ids)])
        elif kind == "park":
            sched.park(pool, tenant)
        elif kind == "unpark":
            sched.unpark(pool=pool)
        elif kind == "requeue" and leases:
            lease_id = leases.pop(number % len(leases))
            if not sched.requeue(lease_id, park=number % 2 == 0):
                sched.release(lease_id)
        elif kind == "policy":
            swapped = not swapped
            reorder = number % 5 == 0
            sched.update_policy(_policy(swapped, reorder=reorder, concurrency=1 + number % 3))
        _check_counts(sched)
