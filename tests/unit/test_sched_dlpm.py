"""DLPM: longest cached prefix first inside the deficits, and the bound docs/locality.md states
(the conformance and property suites run it too, from the registry)."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_support import make_policy, scheduler, submit_ok

from extproc.scheduler import Ticket
from extproc.scheduler.fairness import DeficitLongestPrefixMatch, LocalityAware
from extproc.scheduler.locality import prefix_blocks

_ids = itertools.count(1)


def _ticket(tenant: str, prompt: bytes, tokens: int = 100, output: int = 10) -> Ticket:
    return Ticket(
        f"d{next(_ids)}", tenant, "p", tokens, output, prefix_blocks=prefix_blocks(prompt, 256)
    )


def test_the_longest_cached_prefix_goes_first_within_the_deficits() -> None:
    policy = make_policy(
        {"a": {"tier": "gold"}, "b": {"tier": "gold"}, "c": {"tier": "gold"}},
        fairness="dlpm",
        quantum=10_000,
        pools={"p": {"max_inflight": 1, "max_inflight_tokens": 1_000_000}},
    )
    sched, _ = scheduler(policy)
    system = b"s" * 4096
    submit_ok(sched, _ticket("a", system + b"q1"))
    [first] = sched.dispatch()  # the index now holds the system prompt on the one replica
    submit_ok(sched, _ticket("b", b"u" * 4096))
    submit_ok(sched, _ticket("c", system + b"q2"))
    submit_ok(sched, _ticket("a", b"v" * 4096))
    assert sched.dispatch() == []  # the pool is full
    sched.release(first.lease.lease_id)
    order = []
    for _ in range(3):
        [admission] = sched.dispatch()
        order.append(admission.ticket.tenant)
        sched.release(admission.lease.lease_id)
    # c's prefix is cached; a and b have none, and b was served less recently than a
    assert order == ["c", "b", "a"]
    assert sched.snapshot()["locality"]["pools"]["p"][0]["predicted_hit_tokens"] > 0


def test_without_locality_ties_go_to_the_least_recently_served() -> None:
    dlpm = DeficitLongestPrefixMatch(1000)
    for name in ("a", "b", "c"):
        dlpm.on_backlogged(name, 1.0)
    served = []
    for _ in range(6):
        tenant = dlpm.pick_member(lambda _t: 100.0)
        dlpm.on_dispatch(tenant, 100.0)
        served.append(tenant)
    assert served == ["a", "b", "c", "a", "b", "c"]
    assert isinstance(dlpm, LocalityAware)


def test_a_round_credits_every_candidate_the_rounds_the_first_needs() -> None:
    dlpm = DeficitLongestPrefixMatch(100)
    dlpm.on_backlogged("a", 1.0)
    dlpm.on_backlogged("b", 2.0)
    assert dlpm.pick([("a", 250.0), ("b", 1000.0)]) == "a"  # a needs 3 rounds, b 5
    assert dlpm.level("a") == 300.0
    assert dlpm.level("b") == 600.0
    dlpm.on_dispatch("a", 250.0)
    dlpm.on_idle("b")  # credit is not banked, debt is
    assert dlpm.level("b") == 0.0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=4),
    quantum=st.sampled_from([16, 200, 1000, 5000]),
    steps=st.integers(20, 200),
    data=st.data(),
)
def test_locality_never_buys_more_than_the_bound(
    weights: list[float], quantum: int, steps: int, data: st.DataObject
) -> None:
    """Backlogged tenants whose cached prefixes change arbitrarily between picks: over every
    interval, weighted services differ by less than 2Q + U/w_i + U/w_j, and from the start
    by less than Q + U/min(w) (U: the largest request cost)."""
    names = [f"t{i}" for i in range(len(weights))]
    weight = dict(zip(names, weights, strict=True))
    max_cost = 3000.0
    costs = st.floats(1.0, max_cost)
    head = {name: data.draw(costs) for name in names}
    cached = {name: 0.0 for name in names}
    dlpm = DeficitLongestPrefixMatch(quantum)
    dlpm.bind_locality(cached.__getitem__)
    for name in names:
        dlpm.on_backlogged(name, weight[name])
    served = {name: 0.0 for name in names}
    history = [dict(served)]
    for _ in range(steps):
        for name in names:
            cached[name] = data.draw(st.sampled_from([0.0, 64.0, 640.0, 6400.0]))
        tenant = dlpm.pick_member(head.__getitem__)
        dlpm.on_dispatch(tenant, head[tenant])
        served[tenant] += head[tenant]
        head[tenant] = data.draw(costs)
        history.append(dict(served))
    for i, j in itertools.combinations(names, 2):
        gap_now = abs(served[i] / weight[i] - served[j] / weight[j])
        assert gap_now < quantum + max_cost / min(weight[i], weight[j]) + 1e-6
        bound = 2 * quantum + max_cost / weight[i] + max_cost / weight[j]
        for start, end in itertools.combinations(history, 2):
            gap = (end[i] - start[i]) / weight[i] - (end[j] - start[j]) / weight[j]
            assert abs(gap) < bound + 1e-6
