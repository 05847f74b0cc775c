"""The scheduler's internal records: queue entries, leases, holds, per-pool usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from extproc.scheduler.types import Lease, Ticket

OrderKey = tuple[int, float, float, int]
"""Tenant order (layer d): (-priority, deadline or inf, arrival, sequence number). A plain
tuple, not a NamedTuple: one is built for every submit, and building those costs more."""


@dataclass(eq=False, slots=True)
class QueueEntry:
    ticket: Ticket
    seq: int
    key: OrderKey
    enqueued_at: float
    expires_at: float
    headers: dict[str, str]
    charged: dict[str, float]
    """What submit took from each rate-limit dimension (by name), refunded if never served."""
    alive: bool = True
    bypassed: int = 0
    """Times a request of another tenant went ahead while this one, at the head of its
    tenant's queue, did not fit the pool's token room and was owed the pool (a lower tier's
    request went ahead, or its tenant was not over its share, or `turn_came`)."""
    turn_came: bool = False
    """Its band's fair-share pick has been its tenant while it did not fit: from then on every
    request that goes past it counts as a bypass."""
    stays: int = 0
    """How many times it was put in its queue (more than once when a shared gate refused its
    admission and `Scheduler.requeue` put it back): only the timers of the current stay count."""


class Hold(NamedTuple):
    """A pool held for one tenant's head request (anti-starvation)."""

    rank: int
    tenant: str


@dataclass(slots=True)
class PoolUsage:
    """One tenant's admitted work in one pool (for headroom shares)."""

    requests: int = 0
    tokens: int = 0
    """Their token budgets."""


@dataclass(slots=True)
class LeaseState:
    lease: Lease
    ticket: Ticket
    charged_output: int
    """Output tokens already charged to the fair share (the reservation, then what streamed)."""
    fair_charged: float
    output_seen: int = 0
    entry: QueueEntry | None = None
    """The queue entry it came from, kept so that `requeue` can put it back."""
    light: bool = False
    """Its tenant was within its fair share of the pool when it was dispatched."""
    prefilling: int = 0
    """Its prompt tokens in the pool's prefilling sum, until its first token (then 0)."""
    reserve: bool = False
    """Admitted above a hard limit that had been cut below what was in flight: it holds one
    of the pool's reserve slots (`PoolState.reserve_inflight`) until released."""
    fair_exempt: bool = False
    """Taken through the headroom (a light tenant above the soft limit): the fair share
    neither charges it nor settles it. That capacity is never a backlogged tenant's, so
    counting it made a light tenant pay for it later: a tenant light for minutes ran up a
    DRR debt (or a VTC counter) that its first burst then waited out at the door while the
    flooder was admitted dozens of times (tests/unit/test_sched_headroom_debt.py)."""
    alone_sample: bool = False
    """Admitted while the pool was nearly idle: its first token teaches the alone model."""
    first_token: bool = False
    """Its first token has been seen (`Scheduler.first_token`)."""
    tokens_at: float | None = None
    """When its latest chunk carrying output tokens arrived (None before the first)."""
