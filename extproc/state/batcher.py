"""Coalesce shared-state operations into batches: one script call (one round trip) at a time.

While a batch is in flight, new operations queue; the next batch takes all of them (up to
`max_batch`). Under load a round trip serves many requests; when idle an operation goes out at
once. Order is kept: operations apply in Redis in the order they were submitted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence

from extproc.state.backend import StateUnavailable
from extproc.state.ops import Op, Reply

RunBatch = Callable[[Sequence[Op]], Awaitable[list[Reply]]]


class Batcher:
    def __init__(self, run: RunBatch, max_batch: int = 256) -> None:
        self._run = run
        self._max_batch = max_batch
        self._pending: list[tuple[Op, asyncio.Future[Reply]]] = []
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0
        self.ops = 0

    def submit(self, op: Op) -> asyncio.Future[Reply]:
        """Queue one operation; the future gets its reply or `StateUnavailable`."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if self._closed:
            future.set_exception(StateUnavailable("the state client is closed"))
            return future
        self._pending.append((op, future))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return future

    def fire(self, op: Op) -> asyncio.Future[Reply]:
        """Submit an operation nobody awaits (its failure is retrieved, never raised)."""
        future = self.submit(op)
        future.add_done_callback(_retrieve)
        return future

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            live = [(op, f) for op, f in batch if not f.cancelled()]
            if not live:
                continue
            try:
                replies = await self._run([op for op, _ in live])
            except asyncio.CancelledError:
                for _, future in live:
                    if not future.done():
                        future.set_exception(StateUnavailable("the state client is closing"))
                raise
            except Exception as error:
                failure = error if isinstance(error, StateUnavailable) else StateUnavailable(error)
                for _, future in live:
                    if not future.done():
                        future.set_exception(failure)
                continue
            self.batches += 1
            self.ops += len(live)
            for (_, future), reply in zip(live, replies, strict=True):
                if not future.done():
                    future.set_result(reply)

    async def close(self) -> None:
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for _, future in self._pending:
            if not future.done():
                future.set_exception(StateUnavailable("the state client is closed"))
        self._pending.clear()


def _retrieve(future: asyncio.Future[Reply]) -> None:
    if not future.cancelled():
        future.exception()


def failure(future: asyncio.Future[Reply]) -> BaseException | None:
    """Why a batched operation failed (None: it has a reply)."""
    if future.cancelled():
        return StateUnavailable("cancelled")
    return future.exception()
