"""The capacity leases this process holds in Redis, by scheduler lease id and by request id."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from extproc.scheduler import Ticket


@dataclass(slots=True)
class HeldLease:
    request_id: str
    pool: str
    budget: int
    ticket: Ticket


class HeldLeases:
    def __init__(self) -> None:
        self._held: dict[int, HeldLease] = {}
        self._by_rid: dict[str, int] = {}
        self._per_pool: dict[str, list[int]] = {}
        """pool -> [leases, budget tokens] this process holds there."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._held

    def get(self, lease_id: int) -> HeldLease | None:
        return self._held.get(lease_id)

    def lease_of(self, request_id: str) -> int | None:
        return self._by_rid.get(request_id)

    def request_ids(self) -> set[str]:
        return set(self._by_rid)

    def items(self) -> Iterator[tuple[int, HeldLease]]:
        """A snapshot: the caller may release while iterating."""
        return iter(list(self._held.items()))

    def values(self) -> list[HeldLease]:
        return list(self._held.values())

    def counts(self, pool: str) -> tuple[int, int]:
        """(leases, budget tokens) this process holds in `pool`."""
        mine = self._per_pool.get(pool, [0, 0])
        return mine[0], mine[1]

    def hold(self, lease_id: int, ticket: Ticket) -> bool:
        """Record a granted lease; False if it was held already."""
        if lease_id in self._held:
            return False
        self._held[lease_id] = HeldLease(ticket.request_id, ticket.pool, ticket.budget, ticket)
        self._by_rid[ticket.request_id] = lease_id
        counts = self._per_pool.setdefault(ticket.pool, [0, 0])
        counts[0] += 1
        counts[1] += ticket.budget
        return True

    def forget(self, lease_id: int) -> HeldLease | None:
        held = self._held.pop(lease_id, None)
        if held is None:
            return None
        self._by_rid.pop(held.request_id, None)
        counts = self._per_pool.get(held.pool)
        if counts is not None:
            counts[0] -= 1
            counts[1] -= held.budget
        return held
