"""What the parts of the Redis gate (sync, recovery, remote settlement) share: the gate's
state and its few primitives, as a protocol, so they do not import the gate itself."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from extproc.admission import GateHost
from extproc.policy import Policy
from extproc.policy.model import State
from extproc.scheduler import Admission, Ticket
from extproc.state import ops
from extproc.state.backend import RedisBackend
from extproc.state.batcher import Batcher
from extproc.state.capacity import SharedCapacity
from extproc.state.leases import HeldLeases
from extproc.state.metrics import StateMetrics
from extproc.state.mode import Mode
from extproc.state.ops import Reply
from extproc.state.store import SharedLimitStore


class SharedGate(Protocol):
    mode: Mode
    closed: bool
    policy: Policy
    settings: State
    replica: str
    backend: RedisBackend
    batcher: Batcher
    store: SharedLimitStore
    capacities: dict[str, SharedCapacity]
    state_metrics: StateMetrics
    held: HeldLeases
    tentative: dict[str, int]
    local_only: dict[int, Admission]

    @property
    def host(self) -> GateHost: ...

    def call(self, op: ops.Op, then: Callable[[asyncio.Future[Reply]], None]) -> None: ...

    def send(self, op: ops.Op) -> None: ...

    def failed(self, error: BaseException) -> None: ...

    def observe(self, pool: str, reply: Reply) -> None: ...

    def hold(self, lease_id: int, ticket: Ticket) -> None: ...

    def release_held(
        self, lease_id: int, actual_in: int | None, actual_out: int | None
    ) -> None: ...

    def drop_local(self, lease_id: int) -> None: ...

    def gate_op(self, ticket: Ticket, force: bool = False) -> ops.Gate: ...

    def share(self, policy: Policy) -> Policy: ...

    def mode_changed(self, shared: bool) -> None: ...

    def queue_replay(self, op: ops.Op) -> None: ...
