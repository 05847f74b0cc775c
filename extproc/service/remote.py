"""The accounting stream's hold on a request another process admitted (shared state only).

With `state.backend: redis` the accounting stream may run on another process than the
admission stream: the request is then settled through the shared store by request id
(`AdmissionController.attach_remote`), and the admitting process frees its own lease when it
hears of the release. The admitting process counts and logs the request; this one counts the
tokens it saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from extproc.admission import AdmissionController, RemoteLease
from extproc.metrics import InterTokenClock, Metrics
from extproc.policy import Policy
from extproc.sse import Usage


class RemoteRequestLease:
    def __init__(
        self,
        remote: RemoteLease,
        admission: AdmissionController,
        metrics: Metrics,
        policy: Callable[[], Policy],
        forget: Callable[[RemoteRequestLease], None],
    ) -> None:
        self._remote = remote
        self._admission = admission
        self._metrics = metrics
        self._policy = policy
        self._forget = forget
        self._settled = False
        self.started = time.monotonic()
        self._inter_token: InterTokenClock | None = None
        """Made at the first output chunk: the tenant and pool come from the shared store."""

    def response_started(self, status: int, upstream: str | None) -> None:
        del status, upstream  # the admitting process logs the request

    def first_byte(self, at: float) -> None:
        remote = self._remote
        if remote.tenant is not None and remote.pool is not None:
            self._metrics.ttft_of(remote.tenant, remote.pool).observe(at - self.started)

    @property
    def request_id(self) -> str:
        return self._remote.request_id

    def charge_output(self, tokens: int, largest_gap: float | None = None) -> None:
        clock = self._inter_token
        if clock is None:
            tenant, pool = self._remote.tenant, self._remote.pool
            clock = self._inter_token = InterTokenClock(
                self._metrics.inter_token(tenant, pool)
                if tenant is not None and pool is not None
                else None
            )
        clock.tokens_arrived(tokens, time.monotonic(), largest_gap)
        self._admission.charge_remote(self._remote, tokens)

    def settle(self, usage: Usage | None, output_seen: int) -> None:
        """Usage to the shared store, tokens to this process's metrics."""
        remote = self._remote
        self._forget(self)
        if self._settled:
            return
        self._settled = True
        if usage is not None:
            input_tokens: int | None = usage.prompt_tokens
            output_tokens = usage.completion_tokens
        else:
            input_tokens, output_tokens = None, output_seen
        self._admission.settle_remote(remote, input_tokens, output_tokens)
        if remote.tenant is not None and remote.tenant in self._policy().tenants:
            if input_tokens is not None:
                self._metrics.tokens_of(remote.tenant, "input").inc(input_tokens)
            self._metrics.tokens_of(remote.tenant, "output").inc(output_tokens)
