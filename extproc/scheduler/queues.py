"""Queues and timers: each tenant's queue per pool in tenant order, and the wait, deadline
and lease-expiry timers (heaps with lazy deletion)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from heapq import heapify, heappop, heappush
from typing import NamedTuple

from extproc.scheduler.pools import Band
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.records import OrderKey, QueueEntry


class _Queued(NamedTuple):
    key: OrderKey
    entry: QueueEntry


class TenantQueue:
    """One tenant's queued requests for one pool, in tenant order (a heap, lazy deletion)."""

    __slots__ = ("heap", "live", "tokens", "with_deadline")

    def __init__(self) -> None:
        self.heap: list[_Queued] = []
        self.live = 0
        self.tokens = 0
        """Token budgets of the live entries."""
        self.with_deadline = 0

    def push(self, entry: QueueEntry) -> None:
        heappush(self.heap, _Queued(entry.key, entry))
        self._count(entry, 1)

    def head(self) -> QueueEntry:
        heap = self.heap
        while heap and not heap[0].entry.alive:
            heappop(heap)
        if not heap:
            raise LookupError("empty tenant queue")
        return heap[0].entry

    def pop_head(self) -> QueueEntry:
        entry = self.head()
        heappop(self.heap)
        entry.alive = False
        self._count(entry, -1)
        return entry

    def discard(self, entry: QueueEntry) -> None:
        entry.alive = False
        self._count(entry, -1)
        if len(self.heap) > 32 and len(self.heap) > 2 * self.live:
            self.heap = [item for item in self.heap if item.entry.alive]
            heapify(self.heap)

    def _count(self, entry: QueueEntry, sign: int) -> None:
        self.live += sign
        self.tokens += sign * entry.ticket.budget
        if entry.ticket.deadline is not None:
            self.with_deadline += sign

    def in_order(self) -> list[QueueEntry]:
        return [
            item.entry for item in sorted(self.heap, key=lambda item: item.key) if item.entry.alive
        ]

    def count_before(self, key: OrderKey) -> int:
        return sum(1 for item in self.heap if item.entry.alive and item.key < key)


class TenantState:
    """A tenant's live state: its queues (pool -> queue), counts, and dispatch rate."""

    __slots__ = (
        "arrivals",
        "bands",
        "dispatches",
        "inflight",
        "inflight_tokens",
        "name",
        "queued",
        "queues",
        "served_requests",
        "served_tokens",
    )

    def __init__(self, name: str, dispatches: DecayingRate) -> None:
        self.name = name
        self.queues: dict[str, TenantQueue] = {}
        self.bands: dict[str, Band] = {}
        """Pool -> the band this tenant is a member of (only while backlogged)."""
        self.arrivals: deque[QueueEntry] = deque()
        self.dispatches = dispatches
        self.queued = 0
        self.inflight = 0
        self.inflight_tokens = 0
        self.served_requests = 0
        self.served_tokens = 0

    def queue(self, pool: str) -> TenantQueue:
        found = self.queues.get(pool)
        if found is None:
            found = self.queues[pool] = TenantQueue()
        return found

    def oldest(self) -> QueueEntry | None:
        arrivals = self.arrivals
        while arrivals and not arrivals[0].alive:
            arrivals.popleft()
        return arrivals[0] if arrivals else None


class _EntryTimer(NamedTuple):
    at: float
    seq: int
    entry: QueueEntry


class _LeaseTimer(NamedTuple):
    at: float
    lease_id: int


class Timers:
    """When queued requests expire (max_queue_wait), pass their deadline, and when leases
    expire. Entries that left the queue are skipped lazily."""

    def __init__(self) -> None:
        self._expiries: list[_EntryTimer] = []
        self._deadlines: list[_EntryTimer] = []
        self._leases: list[_LeaseTimer] = []
        self.with_deadline = 0
        """Queued requests that have a deadline (shedding only runs while there are some)."""

    def entry_queued(self, entry: QueueEntry) -> None:
        heappush(self._expiries, _EntryTimer(entry.expires_at, entry.seq, entry))
        if entry.ticket.deadline is not None:
            self.with_deadline += 1
            heappush(self._deadlines, _EntryTimer(entry.ticket.deadline, entry.seq, entry))

    def entry_left(self, entry: QueueEntry) -> None:
        if entry.ticket.deadline is not None:
            self.with_deadline -= 1

    def lease_added(self, expires_at: float, lease_id: int) -> None:
        heappush(self._leases, _LeaseTimer(expires_at, lease_id))

    def expired(self, now: float) -> list[QueueEntry]:
        """Queued entries past their max_queue_wait, taken off the timer."""
        return _due(self._expiries, now)

    def past_deadline(self, now: float) -> list[QueueEntry]:
        return _due(self._deadlines, now)

    def expired_leases(self, now: float) -> Iterator[int]:
        heap = self._leases
        while heap and heap[0].at <= now:
            yield heappop(heap).lease_id

    def next_time(self, lease_alive: Callable[[int], bool]) -> float | None:
        times: list[float] = []
        for heap in (self._expiries, self._deadlines):
            while heap and not heap[0].entry.alive:
                heappop(heap)
            if heap:
                times.append(heap[0].at)
        leases = self._leases
        while leases and not lease_alive(leases[0].lease_id):
            heappop(leases)
        if leases:
            times.append(leases[0].at)
        return min(times) if times else None

    def leases_need_compaction(self, live_leases: int) -> bool:
        return len(self._leases) > 4 * live_leases + 1024

    def entries_need_compaction(self, live_entries: int) -> bool:
        return max(len(self._expiries), len(self._deadlines)) > 4 * live_entries + 1024

    def rebuild_leases(self, leases: Iterable[tuple[float, int]]) -> None:
        self._leases = [_LeaseTimer(at, lease_id) for at, lease_id in leases]
        heapify(self._leases)

    def rebuild_entries(self, entries: Iterable[QueueEntry]) -> None:
        """After expires_at changed (policy update) or dead timers dominate."""
        items = list(entries)
        self._expiries = [_EntryTimer(e.expires_at, e.seq, e) for e in items]
        heapify(self._expiries)
        self._deadlines = [
            _EntryTimer(e.ticket.deadline, e.seq, e) for e in items if e.ticket.deadline is not None
        ]
        heapify(self._deadlines)


def _due(heap: list[_EntryTimer], now: float) -> list[QueueEntry]:
    """Pop the timers due at `now`; the entries still queued (each leaves only by itself,
    so none of them is removed by handling another)."""
    due: list[QueueEntry] = []
    while heap and heap[0].at <= now:
        entry = heappop(heap).entry
        if entry.alive:
            due.append(entry)
    return due
