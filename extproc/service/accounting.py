"""One AccountingProcessor per observability-mode ext_proc stream: count the response's tokens.

The second ext_proc filter in Envoy runs in observability mode: Envoy does not wait for us and
we never reply. It sees the request headers (after the admission filter set
x-gateway-request-id, which links the two streams), the response headers and every response
body chunk. Envoy closes the admission stream as soon as it needs nothing more from it (right
after the response headers), so this stream is the one that knows when the response has ended:
capacity is released and the tenant's account settled here.
"""

from __future__ import annotations

import time

from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders

from extproc.service.gateway import Gateway
from extproc.service.processor import RequestState, header_values
from extproc.sse import JsonUsageParser, SseUsageParser
from extproc.types import GATEWAY_REQUEST_ID_HEADER, UPSTREAM_HEADER


class AccountingProcessor:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.state: RequestState | None = None
        self.sse: SseUsageParser | None = None
        self.json: JsonUsageParser | None = None
        self.charged_output = 0
        self.first_byte_at: float | None = None
        self.ended = False

    def on_request_headers(self, message: HttpHeaders) -> None:
        (request_id,) = header_values(message, GATEWAY_REQUEST_ID_HEADER)
        if request_id is not None:
            self.state = self.gateway.attach_accounting(request_id)

    def on_response_headers(self, message: HttpHeaders) -> None:
        if self.state is None:
            return
        status, content_type, upstream = header_values(
            message, ":status", "content-type", UPSTREAM_HEADER
        )
        self.state.upstream = upstream
        self.state.upstream_status = int(status) if status and status.isdigit() else 0
        if "text/event-stream" in (content_type or ""):
            self.sse = SseUsageParser()
        else:
            self.json = JsonUsageParser()
        if message.end_of_stream:
            self.finish()

    def on_response_body(self, message: HttpBody) -> None:
        state = self.state
        if state is None or self.ended:
            return
        if self.first_byte_at is None and message.body:
            self.first_byte_at = time.monotonic()
            self.gateway.observe_first_byte(state, self.first_byte_at)
        if self.sse is not None:
            self.sse.feed(message.body)
            seen = self.sse.output_tokens_seen
            if seen > self.charged_output:
                self.gateway.charge_output(state, seen - self.charged_output)
                self.charged_output = seen
        elif self.json is not None:
            self.json.feed(message.body)
        if message.end_of_stream:
            self.finish()

    def finish(self) -> None:
        """The response ended (or the stream was cut): settle with what is known."""
        if self.ended or self.state is None:
            return
        self.ended = True
        usage = None
        output_seen = 0
        if self.sse is not None:
            usage = self.sse.usage
            output_seen = self.sse.output_tokens_seen
        elif self.json is not None:
            usage = self.json.finish()
        self.gateway.settle(self.state, usage, output_seen)
