"""The stream processors against fakes of their ports: what each phase asks of the service."""

from __future__ import annotations

import asyncio

import orjson
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody

from extproc.admission import Grant
from extproc.endpoints import EndpointClass
from extproc.errors import GatewayError
from extproc.openai_request import PromptParts
from extproc.policy import Policy, policy_from_text
from extproc.scheduler import Ticket
from extproc.service.accounting import AccountingProcessor
from extproc.service.ports import AccountedLease
from extproc.service.processor import AdmissionProcessor, http_headers
from extproc.service.request import Request
from extproc.sse import Usage
from extproc.types import DEADLINE_HEADER, GATEWAY_REQUEST_ID_HEADER, UPSTREAM_HEADER, Outcome
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import chat_body


class FakeAdmission:
    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.tickets: list[Ticket] = []
        self.admitted_requests: list[Request] = []
        self.ended: list[Request] = []

    @property
    def policy(self) -> Policy:
        return self._policy

    def estimate_prompt(self, prompt: PromptParts) -> int:
        return 7

    def now(self) -> float:
        return 100.0

    def refused_before_body(
        self, request_id: str, tenant: str, endpoint: EndpointClass
    ) -> GatewayError | None:
        return None

    def submit(self, ticket: Ticket) -> asyncio.Future[Grant]:
        self.tickets.append(ticket)
        turn: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        turn.set_result(Grant(lease_id=1, pool=ticket.pool, wait_s=0.25, ratelimit_headers={}))
        return turn

    def cancel(self, request_id: str) -> None:
        raise AssertionError("nothing was cancelled")

    def admitted(self, request: Request) -> None:
        self.admitted_requests.append(request)

    def admission_stream_ended(self, request: Request) -> None:
        self.ended.append(request)


async def test_admission_stream_submits_estimates_and_reports_its_end() -> None:
    port = FakeAdmission(policy_from_text(policy_yaml()))
    processor = AdmissionProcessor(port)
    headers = [
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("authorization", f"Bearer {TEST_KEYS['acme']}"),
        (DEADLINE_HEADER, "2000"),
    ]
    processor.on_request_headers(http_headers(headers))
    replies = [r async for r in processor.on_request_body(HttpBody(body=chat_body(max_tokens=16)))]
    assert len(replies) == 1 and replies[0].HasField("request_body")
    (ticket,) = port.tickets
    assert (ticket.tenant, ticket.input_tokens, ticket.max_output_tokens) == ("acme", 7, 16)
    assert ticket.request_id == processor.request_id
    assert ticket.deadline == 100.0 + 2.0  # on the port's clock
    (request,) = port.admitted_requests
    assert request.outcome is Outcome.ADMITTED and request.budget == 7 + 16
    assert port.ended == []
    processor.finish()
    assert port.ended == [request]


class RecordingLease:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def response_started(self, status: int, upstream: str | None) -> None:
        self.calls.append(("started", status, upstream))

    def first_byte(self, at: float) -> None:
        self.calls.append(("first_byte",))

    def charge_output(self, tokens: int) -> None:
        self.calls.append(("charge", tokens))

    def settle(self, usage: Usage | None, output_seen: int) -> None:
        self.calls.append(("settle", usage, output_seen))


class FakeAccounting:
    def __init__(self, lease: RecordingLease | None) -> None:
        self.lease = lease
        self.asked: list[str] = []

    def attach(self, request_id: str) -> AccountedLease | None:
        self.asked.append(request_id)
        return self.lease


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


def test_accounting_stream_drives_its_lease_through_the_response() -> None:
    lease = RecordingLease()
    port = FakeAccounting(lease)
    processor = AccountingProcessor(port)
    processor.on_request_headers(http_headers([(GATEWAY_REQUEST_ID_HEADER, "rid-1")]))
    assert port.asked == ["rid-1"]
    processor.on_response_headers(
        http_headers(
            [(":status", "200"), ("content-type", "text/event-stream"), (UPSTREAM_HEADER, "e:1")]
        )
    )
    delta = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    processor.on_response_body(HttpBody(body=sse(delta, delta)))
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    processor.on_response_body(HttpBody(body=sse(usage) + b"data: [DONE]\n\n", end_of_stream=True))
    processor.finish()  # the stream closing after the end: settles once only
    assert lease.calls[0] == ("started", 200, "e:1")
    assert lease.calls[1] == ("first_byte",)
    charged = sum(int(str(c[1])) for c in lease.calls if c[0] == "charge")
    assert charged == 2
    settles = [c for c in lease.calls if c[0] == "settle"]
    assert len(settles) == 1
    settled_usage = settles[0][1]
    assert isinstance(settled_usage, Usage)
    assert (settled_usage.prompt_tokens, settled_usage.completion_tokens) == (5, 2)


def test_accounting_stream_of_an_unknown_request_asks_nothing_more() -> None:
    port = FakeAccounting(None)
    processor = AccountingProcessor(port)
    processor.on_request_headers(http_headers([(GATEWAY_REQUEST_ID_HEADER, "nobody")]))
    processor.on_response_headers(http_headers([(":status", "200")], end_of_stream=True))
    processor.finish()
    assert port.asked == ["nobody"]
