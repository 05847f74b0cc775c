"""What the per-stream processors may ask of the service: two narrow ports.

`AdmissionPort` is what an admission stream (extproc.service.processor) needs, `AccountingPort`
what an accounting stream (extproc.service.accounting) needs; `AccountedLease` is the one
protocol for a request the accounting stream settles, whether this process admitted it
(extproc.service.request.LocalLease) or another one did (extproc.service.remote).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from extproc.admission import Grant
from extproc.endpoints import EndpointClass
from extproc.errors import GatewayError
from extproc.openai_request import PromptParts
from extproc.policy import Policy
from extproc.scheduler import Ticket
from extproc.service.request import Request
from extproc.sse import Usage


class AdmissionPort(Protocol):
    @property
    def policy(self) -> Policy:
        """The policy in force (a stream keeps the one it started with)."""

    def estimate_prompt(self, prompt: PromptParts) -> int: ...

    def now(self) -> float:
        """The admission clock (ticket deadlines are on it)."""

    def refused_before_body(
        self, request_id: str, tenant: str, endpoint: EndpointClass
    ) -> GatewayError | None:
        """The refusal any request of `tenant` to `endpoint` would get now whatever its body
        says (a full queue), or None: asked at the request headers."""

    def submit(self, ticket: Ticket) -> asyncio.Future[Grant]:
        """Queue for admission: the future resolves to a grant or raises GatewayError."""

    def cancel(self, request_id: str) -> None:
        """The client left while its request waited."""

    def admitted(self, request: Request) -> None:
        """The request was granted: its accounting stream may now attach to it."""

    def admission_stream_ended(self, request: Request) -> None:
        """The stream ended, however it ended (counted and logged once)."""


class AccountedLease(Protocol):
    def response_started(self, status: int, upstream: str | None) -> None: ...

    def first_byte(self, at: float) -> None: ...

    def charge_output(self, tokens: int, largest_gap: float | None = None) -> None:
        """Output tokens seen so far in the response, beyond those charged before;
        `largest_gap` (s): they came as one batch of chunks (counting in Envoy), and this was
        the longest gap between two of them."""

    def settle(self, usage: Usage | None, output_seen: int) -> None:
        """The response ended: `usage` when the engine reported it, else what passed."""


class AccountingPort(Protocol):
    def attach(self, request_id: str) -> AccountedLease | None:
        """The request of this gateway request id, if any process admitted it."""


class StreamPorts(AdmissionPort, AccountingPort, Protocol):
    """Both ports: what the gRPC servicer dispatches streams to."""
