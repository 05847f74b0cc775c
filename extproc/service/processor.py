"""One AdmissionProcessor per ext_proc stream (= per HTTP request), one method per phase.

It decides the request (identify, parse, estimate, queue for admission, forward) through its
`AdmissionPort`, filling in the request's record (extproc.service.request) as it goes.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterable

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingResponse,
    ProtocolConfiguration,
)

from extproc.admission import Grant
from extproc.endpoints import GENERATIVE_CLASSES, POOLING_CLASSES, EndpointClass, endpoint_class
from extproc.errors import (
    GatewayError,
    bad_request,
    http_answer,
    method_not_allowed,
    misconfigured,
    never_fits_rate_limit,
    not_found,
    too_large,
)
from extproc.identity import identify_tenant
from extproc.openai_request import (
    INFERENCE_PATHS,
    MODELS_PATH,
    InferenceRequest,
    inference_path,
    normalise_path,
    parse_inference_request,
)
from extproc.policy.hold import hold_needed
from extproc.routing import choose_pool
from extproc.scheduler import Ticket, prefix_blocks, render_prompt
from extproc.scheduler.ratelimit import capacity_exceeded
from extproc.service import responses
from extproc.service.ports import AdmissionPort
from extproc.service.request import Request
from extproc.service.roles import ADMISSION_METADATA
from extproc.types import (
    DEADLINE_HEADER,
    GATEWAY_REQUEST_ID_HEADER,
    OWNED_HEADERS,
    POOL_HEADER,
    PRIORITY_HEADER,
    QUEUE_MS_HEADER,
    REPLICA_HEADER,
    TENANT_HEADER,
    TIER_HEADER,
    WORKER_INDEX_ENV,
    Outcome,
)

_BUFFERED = ProcessingMode.BodySendMode.BUFFERED
_STREAMED = ProcessingMode.BodySendMode.STREAMED
_BODY_MODE_NEEDED = (
    "the admission filter does not send the whole request body before the request goes "
    "upstream (processing_mode.request_body_mode must be BUFFERED, or STREAMED with "
    "send_body_without_waiting_for_header_response): requests with a body are refused; "
    "`extproc envoy lint` checks the configuration"
)

_ids = itertools.count(1)


def request_id_prefix(worker_index: str = "") -> str:
    """What this process's request ids start with: its pid and start time in hex, random hex
    (replicas in containers often all run as pid 1 and start in the same second) and, in a
    worker of `serve --workers N`, `w<index>`, which Envoy's counting script reads to send
    the request's events to this worker (extproc.envoy_lua)."""
    worker = worker_index.strip()
    tag = f"w{int(worker)}" if worker.isascii() and worker.isdigit() else ""
    return f"{os.getpid():x}-{int(time.time()):x}-{secrets.token_hex(3)}{tag}"


_ID_PREFIX = request_id_prefix(os.environ.get(WORKER_INDEX_ENV, ""))


def header_map(headers: HttpHeaders) -> dict[str, str]:
    """Envoy sends values in raw_value (bytes); `value` is empty (ARCHITECTURE.md)."""
    return {h.key: h.raw_value.decode("utf-8", "replace") for h in headers.headers.headers}


def http_headers(pairs: Iterable[tuple[str, str]], end_of_stream: bool = False) -> HttpHeaders:
    """The message Envoy sends for these headers (values in raw_value), the inverse of
    header_map: what benchmarks and tests play Envoy with."""
    values = [HeaderValue(key=key, raw_value=value.encode()) for key, value in pairs]
    return HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end_of_stream)


def header_values(headers: HttpHeaders, *names: str) -> list[str | None]:
    """Just the named headers (lower-case names), without decoding the others."""
    found: list[str | None] = [None] * len(names)
    for header in headers.headers.headers:
        key = header.key
        if key in names:
            found[names.index(key)] = header.raw_value.decode("utf-8", "replace")
    return found


def check_endpoint(method: str, path: str) -> None:
    """The service's own allowlist, the same as Envoy's routes (extproc.envoy_routes), so a
    request reaches an engine only admitted even behind an Envoy without them. `path` is
    normalised (normalise_path). Raises GatewayError 404 / 405."""
    if path in INFERENCE_PATHS:
        if method != "POST":
            raise method_not_allowed(path, "POST")
    elif path == MODELS_PATH:
        if method != "GET":
            raise method_not_allowed(path, "GET")
    else:
        endpoints = " or ".join(f"POST {p}" for p in INFERENCE_PATHS)
        raise not_found(f"no such endpoint: this gateway serves {endpoints} and GET {MODELS_PATH}")


def _int_header(headers: dict[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None


class AdmissionProcessor:
    def __init__(self, port: AdmissionPort) -> None:
        self.port = port
        self.policy = port.policy
        self.state = Request(request_id=f"{_ID_PREFIX}-{next(_ids)}", started=time.monotonic())
        self._headers: dict[str, str] = {}
        self._method = ""
        self._turn: asyncio.Future[Grant] | None = None
        self.one_trip = False
        """Envoy sends the body without waiting for our headers reply (`STREAMED` body,
        `send_body_without_waiting_for_header_response`, said in the stream's first message):
        every reply then waits for the whole body, so Envoy waits on us once, not twice."""
        self._chunks: list[bytes] = []
        self._body_bytes = 0
        self._body_mode_ok = True
        """False when Envoy says it sends the body in a way we cannot admit by; a stream
        that does not say (an Envoy before protocol_config) is taken for BUFFERED."""

    @property
    def request_id(self) -> str:
        return self.state.request_id

    def take_protocol(self, config: ProtocolConfiguration) -> None:
        """How Envoy sends the body, from the stream's first message."""
        mode = config.request_body_mode
        self.one_trip = mode == _STREAMED and config.send_body_without_waiting_for_header_response
        self._body_mode_ok = mode == _BUFFERED or self.one_trip

    def _reject(self, error: GatewayError) -> ProcessingResponse:
        self.state.outcome = error.outcome
        # Kept without its traceback: that holds this stream's frame, which holds the request
        # that holds the error, a cycle only a full garbage collection frees, with the event
        # loop stopped (docs/benchmarks.md, "The benchmark's own pauses").
        self.state.error = error.with_traceback(None)
        return responses.immediate(http_answer(error))

    def _upstream_headers(self) -> tuple[list[tuple[str, str]], list[str]]:
        """The headers the gateway sets upstream, and the client's copies of owned headers
        it does not set (removed)."""
        state = self.state
        assert state.tenant is not None and state.tier is not None
        values = [
            (TENANT_HEADER, state.tenant),
            (TIER_HEADER, state.tier),
            (GATEWAY_REQUEST_ID_HEADER, state.request_id),
        ]
        if state.pool is not None:
            values.append((POOL_HEADER, state.pool))
        if state.grant is not None and state.grant.replica is not None:
            values.append((REPLICA_HEADER, str(state.grant.replica)))
        removed = [
            h for h in OWNED_HEADERS if h in self._headers and all(h != name for name, _ in values)
        ]
        return values, removed

    def on_request_headers(self, message: HttpHeaders) -> ProcessingResponse | None:
        """The reply to the headers, or None when it goes with the body's (one trip)."""
        state = self.state
        headers = self._headers = header_map(message)
        self._method = headers.get(":method", "")
        # Without its query string, which may carry a secret (`?api_key=`): this is what the
        # request log shows.
        state.path = headers.get(":path", "").split("?", 1)[0]
        try:
            if not (message.end_of_stream or self._body_mode_ok):
                raise misconfigured(_BODY_MODE_NEEDED)
            state.path = normalise_path(state.path)
            check_endpoint(self._method, state.path)
            state.tenant = identify_tenant(self.policy, headers)
            tenant = self.policy.tenants[state.tenant]
            state.tier = tenant.tier
            limit = self.policy.source.gateway.max_body_bytes
            length = _int_header(headers, "content-length")
            if length is not None and length > limit:
                raise too_large(limit)
        except GatewayError as error:
            return self._reject(error)
        if message.end_of_stream:
            if inference_path(state.path) is not None:
                return self._reject(bad_request("the request has no body", "missing_body"))
            # GET /v1/models: identified, then passed to the default pool.
            state.outcome = Outcome.ADMITTED
            return responses.continue_request_headers(
                *self._upstream_headers(), clear_route_cache=True
            )
        endpoint = endpoint_class(state.path)
        if endpoint is not None:
            # Refused now, Envoy sends no body and the accounting filter behind this one no
            # request headers: a flooder's refusals cost the door two messages less each.
            refused = self.port.refused_before_body(state.request_id, state.tenant, endpoint)
            if refused is not None:
                return self._reject(refused)
        if self.one_trip:
            return None
        # The identified tenant now, the client's claims gone: what Envoy's access log shows
        # if the body is rejected (the route is chosen again once the pool is known).
        return responses.continue_request_headers(*self._upstream_headers())

    def _whole_body(self, message: HttpBody) -> bytes | None:
        """The whole body: this message's (BUFFERED), or, one trip, the pieces gathered once
        the last is in (None until then). Raises GatewayError 413 as soon as it passes the
        limit."""
        limit = self.policy.source.gateway.max_body_bytes
        piece: bytes = message.body
        if not self.one_trip:
            if len(piece) > limit:
                raise too_large(limit)
            return piece
        self._body_bytes += len(piece)
        if self._body_bytes > limit:
            raise too_large(limit)
        self._chunks.append(piece)
        return b"".join(self._chunks) if message.end_of_stream else None

    async def on_request_body(self, message: HttpBody) -> AsyncIterator[ProcessingResponse]:
        state = self.state
        if state.tenant is None or state.outcome is not None:
            yield responses.continue_request_body()
            return
        try:
            body = self._whole_body(message)
        except GatewayError as error:
            yield self._reject(error)
            return
        if body is None:
            return
        path = inference_path(state.path)
        if path is None or self._method != "POST":
            # Only behind an Envoy without the gateway's routes (check_endpoint): the
            # gateway's headers, the body unchanged.
            state.outcome = Outcome.ADMITTED
            for reply in self._replies(*self._upstream_headers()):
                yield reply
            return
        try:
            request = parse_inference_request(path, body)
            state.prompt = request.prompt
            state.prompt_estimate = self.port.estimate_prompt(request.prompt)
            max_output = self._max_output(request)
            state.budget = state.prompt_estimate + max_output
            longest = request.longest_input
            sequence = state.budget if longest is None else self.port.estimate_prompt(longest)
            state.pool = choose_pool(self.policy, sequence, request.endpoint)
            ticket = self._ticket(request.endpoint, max_output, request.stream)
            exceeded = capacity_exceeded(ticket, self.policy.tenants[state.tenant].limits)
            if exceeded is not None:
                raise never_fits_rate_limit(state.tenant, state.budget, *exceeded)
        except GatewayError as error:
            yield self._reject(error)
            return
        turn = self._turn = self.port.submit(ticket)
        if not turn.done():
            assert state.tenant is not None
            yield responses.hold(hold_needed(self.policy.tenants[state.tenant].limits))
        try:
            state.grant = await turn
        except GatewayError as error:
            yield self._reject(error)
            return
        finally:
            if state.grant is None:
                self._settle_turn(turn)
            self._turn = None
        state.outcome = Outcome.ADMITTED
        self.port.admitted(state)
        state.forwarded = True
        for reply in self._forward(request, state.grant):
            yield reply

    def _max_output(self, request: InferenceRequest) -> int:
        """The output tokens reserved: none for a pooling request (embeddings, rerank), so
        its budget and fair-share cost are its input alone."""
        if request.endpoint not in GENERATIVE_CLASSES:
            return 0
        return request.max_tokens or self.policy.source.gateway.default_max_tokens

    def _forward(self, request: InferenceRequest, grant: Grant) -> list[ProcessingResponse]:
        """Let the request go upstream with the gateway's headers, and with the engine
        `priority` the scheduler chose, if any (it replaces the client's own; a pooling call
        to a pool with `pooling_priority` carries that one instead); the client's
        response headers (x-ratelimit-*, the queue wait) go to Envoy as dynamic metadata,
        which Envoy adds to the response itself (extproc.envoy_config), since this stream
        ends now.

        A streamed request without `stream_options.include_usage` gets it added: the engine
        then ends the stream with one usage chunk (`"choices": []`), which is the only exact
        count of prompt and output tokens we can observe without holding every chunk in a
        synchronous filter. The client receives that one extra chunk; it is part of the
        OpenAI streaming format and OpenAI SDKs accept it. Counting deltas instead would miss
        the prompt tokens and merged or withheld tokens. A pooling request is never streamed
        (its parse says so): its JSON response carries usage; its body changes only to carry
        its engine priority (the pool's `pooling_priority`, which puts a batch behind chat).
        """
        values, removed = self._upstream_headers()
        body = None
        priority = grant.engine_priority
        if request.endpoint in POOLING_CLASSES:
            assert self.state.pool is not None
            pooling = self.policy.pools[self.state.pool].pooling_priority
            priority = priority if pooling is None else pooling
        add_usage = request.stream and not request.include_usage
        if add_usage:
            options = request.body.get("stream_options") or {}
            request.body["stream_options"] = {**options, "include_usage": True}
        if priority is not None:
            request.body["priority"] = priority
        if add_usage or priority is not None:
            body = orjson.dumps(request.body)
        replies = self._replies(values, removed, body)
        response_headers = dict(grant.ratelimit_headers)
        response_headers[QUEUE_MS_HEADER] = f"{grant.wait_s * 1000.0:.1f}"
        responses.fill_metadata(replies[-1], ADMISSION_METADATA, response_headers)
        return replies

    def _replies(
        self, values: list[tuple[str, str]], removed: list[str], body: bytes | None = None
    ) -> list[ProcessingResponse]:
        """The replies that let the request go upstream with these headers (routed again on
        them) and `body` in place of the client's (None: unchanged)."""
        if not self.one_trip:
            if body is not None:
                # Envoy answers 500 if a body mutation leaves a stale content-length.
                values = [*values, ("content-length", str(len(body)))]
            return [
                responses.continue_request_body(values, removed, clear_route_cache=True, body=body)
            ]
        # One trip: the headers go upstream on their reply, before the body, so they carry
        # the route; each piece's reply replaces that piece, and Envoy sends the body chunked
        # (it drops the content-length in this mode).
        replies = [responses.continue_request_headers(values, removed, clear_route_cache=True)]
        earlier = responses.continue_request_body if body is None else responses.clear_request_chunk
        replies.extend(earlier() for _ in self._chunks[:-1])
        replies.append(responses.continue_request_body(body=body))
        return replies

    def _settle_turn(self, turn: asyncio.Future[Grant]) -> None:
        """The wait ended without a grant in hand: the client left (Envoy cancelled us),
        possibly while the hold reply was being sent, before the wait even began."""
        if turn.cancelled() or not turn.done():
            turn.cancel()
            self.port.cancel(self.state.request_id)
            self.state.outcome = Outcome.CANCELLED
        elif turn.exception() is None:
            # Admitted in the same instant the stream was cancelled: finish() releases it.
            self.state.grant = turn.result()

    def _ticket(self, endpoint: EndpointClass, max_output: int, streamed: bool) -> Ticket:
        state = self.state
        assert state.tenant is not None and state.tier is not None and state.pool is not None
        tenant = self.policy.tenants[state.tenant]
        priority = self.policy.clamp_priority(tenant, _int_header(self._headers, PRIORITY_HEADER))
        deadline_ms = _int_header(self._headers, DEADLINE_HEADER)
        relative = (
            deadline_ms / 1000.0
            if deadline_ms is not None and deadline_ms > 0
            else self.policy.default_deadline(state.tier)
        )
        return Ticket(
            request_id=state.request_id,
            tenant=state.tenant,
            pool=state.pool,
            input_tokens=state.prompt_estimate,
            max_output_tokens=max_output,
            priority=priority,
            deadline=None if relative is None else self.port.now() + relative,
            endpoint=endpoint,
            streamed=streamed,
            prefix_blocks=self._prefix_blocks(),
        )

    def _prefix_blocks(self) -> tuple[int, ...]:
        """The prompt's block names for the locality index (fairness dlpm only)."""
        fairness = self.policy.source.fairness
        prompt = self.state.prompt
        if fairness.policy != "dlpm" or prompt is None:
            return ()
        data = render_prompt(prompt.texts, prompt.tools_json)
        return prefix_blocks(data, fairness.locality.block_bytes)

    def finish(self) -> None:
        """Runs when the stream ends, however it ends: release, count, log."""
        if self._turn is not None and self.state.grant is None:
            self._settle_turn(self._turn)
        if self.state.outcome is None:
            self.state.outcome = Outcome.CANCELLED
        self.port.admission_stream_ended(self.state)
