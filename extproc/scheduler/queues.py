"""Queues and timers: each tenant's queue per pool in tenant order, and the wait, deadline
and lease-expiry timers (heaps with lazy deletion)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from heapq import heapify, heappop, heappush

from extproc.endpoints import EndpointClass
from extproc.scheduler.pools import Band
from extproc.scheduler.rates import DecayingRate
from extproc.scheduler.records import OrderKey, QueueEntry


class TenantQueue:
    """One tenant's queued requests for one pool, in tenant order (a heap, lazy deletion).

    Heap items are plain (order key, entry) tuples, here and in `Timers`: every submit pushes
    a few, and NamedTuples cost more to build."""

    __slots__ = ("heap", "live", "tokens", "with_deadline")

    def __init__(self) -> None:
        self.heap: list[tuple[OrderKey, QueueEntry]] = []
        self.live = 0
        self.tokens = 0
        """Token budgets of the live entries."""
        self.with_deadline = 0

    def push(self, entry: QueueEntry) -> None:
        heappush(self.heap, (entry.key, entry))
        self._count(entry, 1)

    def head(self) -> QueueEntry:
        heap = self.heap
        while heap:
            entry = heap[0][1]
            if entry.alive:
                return entry
            heappop(heap)
        raise LookupError("empty tenant queue")

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
            self.heap = [item for item in self.heap if item[1].alive]
            heapify(self.heap)

    def _count(self, entry: QueueEntry, sign: int) -> None:
        ticket = entry.ticket
        self.live += sign
        self.tokens += sign * (ticket.input_tokens + ticket.max_output_tokens)
        if ticket.deadline is not None:
            self.with_deadline += sign

    def in_order(self) -> list[QueueEntry]:
        return [entry for _key, entry in sorted(self.heap, key=lambda item: item[0]) if entry.alive]

    def count_before(self, key: OrderKey) -> int:
        return sum(1 for k, entry in self.heap if entry.alive and k < key)


class TenantState:
    """A tenant's live state: its queues (pool -> queue), counts, and dispatch rate."""

    __slots__ = (
        "arrivals",
        "bands",
        "dispatches",
        "inflight",
        "inflight_by_class",
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
        self.inflight_by_class: dict[EndpointClass, int] = {}
        """Admitted requests per endpoint class (for the classes' max_concurrency)."""
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

    def prune_arrivals(self) -> None:
        """Drop the entries that left the queue (else every request ever made stays here)."""
        self.arrivals = deque(entry for entry in self.arrivals if entry.alive)


EntryTimer = tuple[float, int, int, QueueEntry]
"""(time, entry seq, the entry's stay in the queue, entry): unique per stay, so a requeued
entry's timers never tie and its earlier stay's timer is told apart (`_current`)."""


def _current(item: EntryTimer) -> bool:
    entry = item[3]
    return entry.alive and item[2] == entry.stays


class Timers:
    """When queued requests expire (max_queue_wait), pass their deadline, and when leases
    expire. Entries that left the queue, and the timers of a requeued entry's earlier stay,
    are skipped lazily. Heap items: `EntryTimer` and (time, lease id)."""

    def __init__(self) -> None:
        self._expiries: list[EntryTimer] = []
        self._deadlines: list[EntryTimer] = []
        self._leases: list[tuple[float, int]] = []
        self.with_deadline = 0
        """Queued requests that have a deadline (shedding only runs while there are some)."""

    def entry_queued(self, entry: QueueEntry) -> None:
        entry.stays += 1
        heappush(self._expiries, (entry.expires_at, entry.seq, entry.stays, entry))
        deadline = entry.ticket.deadline
        if deadline is not None:
            self.with_deadline += 1
            heappush(self._deadlines, (deadline, entry.seq, entry.stays, entry))

    def entry_left(self, entry: QueueEntry) -> None:
        if entry.ticket.deadline is not None:
            self.with_deadline -= 1

    def lease_added(self, expires_at: float, lease_id: int) -> None:
        heappush(self._leases, (expires_at, lease_id))

    def expired(self, now: float) -> Sequence[QueueEntry]:
        """Queued entries past their max_queue_wait, taken off the timer."""
        return _due(self._expiries, now)

    def past_deadline(self, now: float) -> Sequence[QueueEntry]:
        return _due(self._deadlines, now)

    def earliest_deadline(self) -> float | None:
        """The earliest deadline of a queued request (None: no queued request has one)."""
        heap = self._deadlines
        while heap and not _current(heap[0]):
            heappop(heap)
        return heap[0][0] if heap else None

    def expired_leases(self, now: float) -> Iterator[int]:
        heap = self._leases
        while heap and heap[0][0] <= now:
            yield heappop(heap)[1]

    def leases_due(self, now: float) -> bool:
        """Whether a lease timer is due (cheap: `poll` asks before reclaiming)."""
        return bool(self._leases) and self._leases[0][0] <= now

    def next_time(self, lease_alive: Callable[[int], bool]) -> float | None:
        at: float | None = None
        for heap in (self._expiries, self._deadlines):
            while heap and not _current(heap[0]):
                heappop(heap)
            if heap and (at is None or heap[0][0] < at):
                at = heap[0][0]
        leases = self._leases
        while leases and not lease_alive(leases[0][1]):
            heappop(leases)
        if leases and (at is None or leases[0][0] < at):
            at = leases[0][0]
        return at

    def leases_need_compaction(self, live_leases: int) -> bool:
        return len(self._leases) > 4 * live_leases + 1024

    def entries_need_compaction(self, live_entries: int) -> bool:
        return max(len(self._expiries), len(self._deadlines)) > 4 * live_entries + 1024

    def rebuild_leases(self, leases: Iterable[tuple[float, int]]) -> None:
        self._leases = list(leases)
        heapify(self._leases)

    def rebuild_entries(self, entries: Iterable[QueueEntry]) -> None:
        """After expires_at changed (policy update) or dead timers dominate."""
        items = list(entries)
        self._expiries = [(e.expires_at, e.seq, e.stays, e) for e in items]
        heapify(self._expiries)
        self._deadlines = [
            (e.ticket.deadline, e.seq, e.stays, e) for e in items if e.ticket.deadline is not None
        ]
        heapify(self._deadlines)


def _due(heap: list[EntryTimer], now: float) -> Sequence[QueueEntry]:
    """Pop the timers due at `now`; the entries still queued, each once (each leaves only by
    itself, so none of them is removed by handling another)."""
    if not heap or heap[0][0] > now:
        return ()  # the common case, without building a list
    due: list[QueueEntry] = []
    while heap and heap[0][0] <= now:
        item = heappop(heap)
        if _current(item):
            due.append(item[3])
    return due
