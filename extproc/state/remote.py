"""Settling, through Redis, requests another process admitted (for a `RedisGate`).

The accounting stream of a request may run on another process than its admission stream:
it finds the lease in Redis by request id, charges output to it and releases it there; the
admitting process hears the release event and frees its local lease.
"""

from __future__ import annotations

import asyncio
from functools import partial

from extproc.admission import RemoteLease
from extproc.state import ops
from extproc.state.batcher import failure
from extproc.state.mode import Mode
from extproc.state.ops import Reply
from extproc.state.shared import SharedGate


class RemoteSettlements:
    def __init__(self, gate: SharedGate) -> None:
        self.gate = gate

    def attach(self, request_id: str) -> RemoteLease:
        remote = RemoteLease(request_id)
        if self.gate.mode is not Mode.SHARED:
            remote.found = False
            return remote
        self.gate.call(ops.Attach(request_id), partial(self._after_attach, remote))
        return remote

    def _after_attach(self, remote: RemoteLease, future: asyncio.Future[Reply]) -> None:
        error = failure(future)
        if error is not None:
            remote.found = False
            self.gate.failed(error)
            return
        reply = future.result()
        remote.found = bool(reply.get("ok"))
        if remote.found:
            remote.tenant = str(reply.get("t"))
            remote.pool = str(reply.get("p"))

    def charge(self, remote: RemoteLease, tokens: int) -> None:
        if tokens > 0 and not remote.settled and self.gate.mode is Mode.SHARED:
            self.gate.send(ops.ChargeOutput(remote.request_id, tokens))

    def settle(
        self, remote: RemoteLease, input_tokens: int | None, output_tokens: int | None
    ) -> None:
        if remote.settled:
            return
        remote.settled = True
        if remote.found is False:
            self.gate.state_metrics.remote_settlements.labels("not_found").inc()
            return
        op = ops.Release(remote.request_id, input_tokens, output_tokens)
        self.gate.call(op, partial(self._after_settle, op))

    def _after_settle(self, op: ops.Release, future: asyncio.Future[Reply]) -> None:
        error = failure(future)
        if error is not None:
            self.gate.queue_replay(op)
            self.gate.failed(error)
            return
        found = bool(future.result().get("ok"))
        result = "settled" if found else "not_found"
        self.gate.state_metrics.remote_settlements.labels(result).inc()
