"""`pick_member` (the dispatcher's fast path when every head fits) answers exactly as `pick`
over every member, and leaves the policy in the same state, for every registered policy."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.scheduler import FAIRNESS_POLICIES, make_fairness

_TENANTS = [f"t{i}" for i in range(6)]
_events = st.lists(
    st.tuples(
        st.sampled_from(["join", "leave", "pick", "charge"]),
        st.sampled_from(_TENANTS),
        st.integers(min_value=-300, max_value=3000),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    events=_events,
    policy=st.sampled_from(sorted(FAIRNESS_POLICIES)),
    quantum=st.sampled_from([16, 64, 4096]),
)
def test_pick_member_matches_pick(
    events: list[tuple[str, str, int]], policy: str, quantum: int
) -> None:
    fast = make_fairness(policy, quantum)
    members: dict[str, None] = {}
    costs = {name: 100.0 + 37 * i for i, name in enumerate(_TENANTS)}
    for kind, tenant, amount in events:
        if kind == "join":
            fast.on_backlogged(tenant, 1.0 + _TENANTS.index(tenant) % 3)
            members[tenant] = None
        elif kind == "leave" and tenant in members:
            fast.on_idle(tenant)
            del members[tenant]
        elif kind == "charge":
            fast.charge(tenant, float(amount))
        elif kind == "pick" and members:
            slow = copy.deepcopy(fast)
            expected = slow.pick([(name, costs[name]) for name in members])
            got = fast.pick_member(costs.__getitem__)
            assert got == expected
            assert got in members
            for name in _TENANTS:
                assert fast.level(name) == slow.level(name)
            cost = costs[got]
            fast.on_dispatch(got, cost)
            costs[got] = 100.0 + (cost * 7) % 900
