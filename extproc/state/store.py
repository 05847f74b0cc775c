"""`SharedLimitStore`: the scheduler's synchronous `LimitStore` on top of the shared store.

The scheduler core calls its store synchronously; Redis answers asynchronously. The adapter
(`RedisGate`) therefore takes a request's buckets in Redis *before* it calls
`Scheduler.submit`, and hands the result over with `prepare`: the `try_take` that submit makes
right after returns it (nothing else runs in between: one event loop, no await).

Where each operation goes:

* shared mode: `try_take` answers the prepared Redis result; `give_back` (a refund for work
  never served) is sent to Redis; `adjust` (settlement) is a no-op because the lease release in
  Redis settles the token buckets atomically with freeing capacity (exactly once);
* local mode (Redis unreachable, `on_failure: local`): a `MemoryLimitStore` with the policy's
  limits divided by the expected replicas (the scheduler runs a scaled policy then). The net
  consumption taken locally is remembered as a debt per bucket and debited to Redis when it
  comes back, so an outage cannot be used to exceed a limit over its window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from extproc.scheduler.limits import (
    Bucket,
    MemoryLimitStore,
    Take,
    TakeResult,
    refilled,
)
from extproc.state.ops import GiveBack, Op

SendOp = Callable[[Op], None]


class SharedLimitStore:
    def __init__(self, send: SendOp) -> None:
        self._send = send
        self.shared = True
        self.local = MemoryLimitStore()
        self._prepared: TakeResult | None = None
        self._known: dict[str, tuple[float, float]] = {}
        """Bucket key -> (level, local time) from the last Redis answer, for snapshots."""
        self.debt: dict[str, tuple[Bucket, float]] = {}

    # -- handing over an asynchronous take ------------------------------------------------------

    def prepare(self, result: TakeResult) -> None:
        self._prepared = result

    def unused(self) -> TakeResult | None:
        """The prepared result if `submit` rejected the request before taking (then the
        caller refunds it); clears it either way."""
        result, self._prepared = self._prepared, None
        return result

    def remember(self, takes: Sequence[Take], levels: Sequence[float], now: float) -> None:
        for take, level in zip(takes, levels, strict=False):
            self._known[take.bucket.key] = (level, now)

    # -- LimitStore -----------------------------------------------------------------------------

    def try_take(self, takes: Sequence[Take], now: float) -> TakeResult:
        prepared, self._prepared = self._prepared, None
        if prepared is not None and len(prepared.levels) == len(takes):
            return prepared
        result = self.local.try_take(takes, now)
        if result.ok and not self.shared:
            for take in takes:
                self._owe(take.bucket, take.cost)
        return result

    def give_back(self, bucket: Bucket, amount: float, now: float) -> None:
        if self.shared:
            self._send(GiveBack(bucket, amount))
            return
        self.local.give_back(bucket, amount, now)
        self._owe(bucket, -amount)

    def adjust(self, bucket: Bucket, delta: float, now: float) -> None:
        if self.shared:
            return  # settled by the lease release in Redis
        self.local.adjust(bucket, delta, now)
        self._owe(bucket, delta)

    def level(self, bucket: Bucket, now: float) -> float:
        if not self.shared:
            return self.local.level(bucket, now)
        known = self._known.get(bucket.key)
        if known is None:
            return bucket.capacity
        return refilled(known[0], known[1], bucket, now)

    # -- outage bookkeeping ---------------------------------------------------------------------

    def _owe(self, bucket: Bucket, amount: float) -> None:
        previous = self.debt.get(bucket.key)
        total = amount if previous is None else previous[1] + amount
        self.debt[bucket.key] = (bucket, total)

    def take_debt(self) -> list[tuple[Bucket, float]]:
        """What was consumed locally during the outage (cleared); the local store restarts."""
        debt = [(bucket, amount) for bucket, amount in self.debt.values() if amount > 0]
        self.debt.clear()
        self.local = MemoryLimitStore()
        return debt
