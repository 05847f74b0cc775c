"""The two fair-share policies on their own: DRR equals a naive round-robin loop, VTC lifts."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.scheduler import DeficitRoundRobin, VirtualTokenCounter, make_fairness

queues_strategy = st.lists(
    st.tuples(st.integers(1, 4), st.lists(st.integers(1, 5000), min_size=1, max_size=12)),
    min_size=1,
    max_size=5,
)


def naive_drr(quantum: int, flows: list[tuple[int, list[int]]]) -> list[int]:
    """Textbook DRR (Shreedhar & Varghese), looping visit by visit."""
    queues = [deque(costs) for _w, costs in flows]
    deficit = [0] * len(flows)
    active = deque(range(len(flows)))
    served: list[int] = []
    while active:
        flow = active.popleft()
        deficit[flow] += quantum * flows[flow][0]
        while queues[flow] and queues[flow][0] <= deficit[flow]:
            deficit[flow] -= queues[flow].popleft()
            served.append(flow)
        if queues[flow]:
            active.append(flow)
        else:
            deficit[flow] = 0
    return served


def driven(policy: DeficitRoundRobin | VirtualTokenCounter, flows: list[tuple[int, list[int]]]):  # type: ignore[no-untyped-def]
    queues = {f"t{i}": deque(costs) for i, (_w, costs) in enumerate(flows)}
    for i, (weight, _costs) in enumerate(flows):
        policy.on_backlogged(f"t{i}", float(weight))
    served: list[int] = []
    while any(queues.values()):
        candidates = [(name, float(q[0])) for name, q in queues.items() if q]
        chosen = policy.pick(candidates)
        policy.on_dispatch(chosen, float(queues[chosen].popleft()))
        served.append(int(chosen[1:]))
        if not queues[chosen]:
            policy.on_idle(chosen)
    return served


@settings(max_examples=200, deadline=None)
@given(quantum=st.integers(1, 3000), flows=queues_strategy)
def test_drr_pick_matches_textbook_drr(quantum: int, flows: list[tuple[int, list[int]]]) -> None:
    assert driven(DeficitRoundRobin(quantum), flows) == naive_drr(quantum, flows)


def naive_vtc(flows: list[tuple[int, list[int]]]) -> list[int]:
    queues = [deque(costs) for _w, costs in flows]
    counter = [0.0] * len(flows)
    served: list[int] = []
    while any(queues):
        flow = min((i for i, q in enumerate(queues) if q), key=lambda i: (counter[i], i))
        counter[flow] += queues[flow].popleft() / flows[flow][0]
        served.append(flow)
    return served


@settings(max_examples=200, deadline=None)
@given(flows=queues_strategy)
def test_vtc_serves_smallest_counter(flows: list[tuple[int, list[int]]]) -> None:
    assert driven(VirtualTokenCounter(), flows) == naive_vtc(flows)


def test_vtc_counter_lift_does_not_bank_idle_time() -> None:
    vtc = VirtualTokenCounter()
    vtc.on_backlogged("busy", 1.0)
    vtc.on_dispatch("busy", 10_000.0)
    vtc.on_backlogged("other", 1.0)
    vtc.on_dispatch("other", 12_000.0)
    vtc.on_backlogged("late", 1.0)  # lifted to the smallest backlogged counter, not 0
    assert vtc.level("late") == 10_000.0
    # When nobody is backlogged, the floor is the last leaver's counter.
    for name in ("busy", "other", "late"):
        vtc.on_idle(name)
    vtc.on_backlogged("newcomer", 1.0)
    assert vtc.level("newcomer") == 10_000.0
    # Weights divide the cost.
    vtc.set_weight("newcomer", 4.0)
    vtc.charge("newcomer", 400.0)
    assert vtc.level("newcomer") == 10_100.0


def test_drr_drops_credit_but_keeps_debt_when_idle() -> None:
    drr = DeficitRoundRobin(1000)
    drr.on_backlogged("a", 1.0)
    assert drr.pick([("a", 300.0)]) == "a"
    drr.on_dispatch("a", 300.0)
    assert drr.level("a") == 700.0
    drr.on_idle("a")
    assert drr.level("a") == 0.0
    drr.charge("a", 500.0)  # streamed output above the reservation, while idle
    assert drr.level("a") == -500.0
    drr.charge("a", -800.0)  # a settlement refund never turns into banked credit
    assert drr.level("a") == 0.0


def test_make_fairness() -> None:
    assert make_fairness("drr", 10).name == "drr"
    assert make_fairness("vtc", 10).name == "vtc"
