"""One AccountingProcessor per observability-mode ext_proc stream: count the response's tokens.

The second ext_proc filter in Envoy runs in observability mode: Envoy does not wait for us and
we never reply. It sees the request headers (after the admission filter set
x-gateway-request-id, which links the two streams), the response headers and every response
body chunk. The admission stream ends as soon as the request is forwarded, so this stream is
the one that knows when the response has ended:
capacity is released and the tenant's account settled here, through the request's
`AccountedLease` (the same for a request admitted here or by another process).
"""

from __future__ import annotations

import time

from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders

from extproc.service.ports import AccountedLease, AccountingPort
from extproc.service.processor import header_values
from extproc.sse import JsonUsageParser, SseUsageParser
from extproc.types import GATEWAY_REQUEST_ID_HEADER, UPSTREAM_HEADER


class AccountingProcessor:
    def __init__(self, port: AccountingPort) -> None:
        self.port = port
        self.lease: AccountedLease | None = None
        self.sse: SseUsageParser | None = None
        self.json: JsonUsageParser | None = None
        self.charged_output = 0
        self.first_byte_at: float | None = None
        self.ended = False

    def on_request_headers(self, message: HttpHeaders) -> None:
        (request_id,) = header_values(message, GATEWAY_REQUEST_ID_HEADER)
        if request_id is not None:
            self.lease = self.port.attach(request_id)

    def on_response_headers(self, message: HttpHeaders) -> None:
        if self.lease is None:
            return
        status, content_type, upstream = header_values(
            message, ":status", "content-type", UPSTREAM_HEADER
        )
        self.lease.response_started(int(status) if status and status.isdigit() else 0, upstream)
        if "text/event-stream" in (content_type or ""):
            self.sse = SseUsageParser()
        else:
            self.json = JsonUsageParser()
        if message.end_of_stream:
            self.finish()

    def on_response_body(self, message: HttpBody) -> None:
        lease = self.lease
        if lease is None or self.ended:
            return
        if self.first_byte_at is None and message.body:
            self.first_byte_at = time.monotonic()
            lease.first_byte(self.first_byte_at)
        if self.sse is not None:
            self.sse.feed(message.body)
            seen = self.sse.output_tokens_seen
            if seen > self.charged_output:
                lease.charge_output(seen - self.charged_output)
                self.charged_output = seen
        elif self.json is not None:
            self.json.feed(message.body)
        if message.end_of_stream:
            self.finish()

    def finish(self) -> None:
        """The response ended (or the stream was cut): settle with what is known."""
        if self.ended or self.lease is None:
            return
        self.ended = True
        usage = None
        output_seen = 0
        if self.sse is not None:
            usage = self.sse.usage
            output_seen = self.sse.output_tokens_seen
        elif self.json is not None:
            usage = self.json.finish()
        self.lease.settle(usage, output_seen)
