"""The engine's waiting queue under vLLM V1's two scheduling policies.

- "fcfs": arrival order; a preempted request goes back to the front (vLLM `prepend_request`).
- "priority": lowest `priority` value first, ties by arrival time then by submission order; a
  preempted request is simply re-queued with its original key, as vLLM's heap does.

Entries are objects with `priority`, `arrival_time`, `order` and `aborted` attributes. An
aborted entry stays in the queue, flagged, and is dropped when it reaches the head, so an abort
never scans the queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, Protocol, TypeVar

SCHEDULING_POLICIES = ("fcfs", "priority")


class QueueEntry(Protocol):
    priority: int
    arrival_time: float
    order: int
    aborted: bool


Entry = TypeVar("Entry", bound=QueueEntry)


class WaitingQueue(Generic[Entry]):
    """Waiting requests in the order the policy admits them."""

    def __init__(self, policy: str) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"unknown scheduling policy {policy!r}; known: {', '.join(SCHEDULING_POLICIES)}"
            )
        self._by_priority = policy == "priority"
        self._fifo: deque[Entry] = deque()
        self._heap: list[tuple[int, float, int, Entry]] = []
        self._live = 0

    def __len__(self) -> int:
        """Waiting requests that are not aborted."""
        return self._live

    def add(self, entry: Entry) -> None:
        """Queue a new arrival."""
        if self._by_priority:
            heapq.heappush(self._heap, (entry.priority, entry.arrival_time, entry.order, entry))
        else:
            self._fifo.append(entry)
        self._live += 1

    def add_preempted(self, entry: Entry) -> None:
        """Queue a request that was preempted from the running batch."""
        if self._by_priority:
            self.add(entry)
        else:
            self._fifo.appendleft(entry)
            self._live += 1

    def mark_aborted(self, entry: Entry) -> None:
        entry.aborted = True
        self._live -= 1

    def peek(self) -> Entry | None:
        """The next request the policy would admit, or None if none waits."""
        if self._by_priority:
            heap = self._heap
            while heap and heap[0][3].aborted:
                heapq.heappop(heap)
            return heap[0][3] if heap else None
        fifo = self._fifo
        while fifo and fifo[0].aborted:
            fifo.popleft()
        return fifo[0] if fifo else None

    def pop(self) -> Entry:
        """Remove and return the head `peek` returned; call only after a non-None peek."""
        entry = heapq.heappop(self._heap)[3] if self._by_priority else self._fifo.popleft()
        self._live -= 1
        return entry
