"""What the service records for the status page that its counters cannot say: the last
rejections (who as identified, why, Retry-After) and the inter-token latency of streams."""

from __future__ import annotations

import types
from collections.abc import AsyncIterator, Iterable

import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import Metric

from extproc.metrics import WeightedHistogram
from extproc.policy import policy_from_text
from extproc.service import request as request_record
from extproc.service.accounting import AccountingProcessor
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.processor import AdmissionProcessor, http_headers
from extproc.status.readings import histogram_buckets, quantile
from extproc.types import GATEWAY_REQUEST_ID_HEADER
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import EnvoyPeer, body_message, chat_body, headers_message
from tests.grpc_support import served_stub

ONE_PER_MINUTE = "{requests_per_minute: 1, tokens_per_minute: 1000000, max_queued: 64}"
Service = tuple[Gateway, ext_proc_grpc.ExternalProcessorStub]


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    gateway = compose(policy_from_text(policy_yaml(initech_limits=ONE_PER_MINUTE)))
    async with served_stub(gateway, close_gateway=True) as stub:
        yield gateway, stub


async def chat(stub: ext_proc_grpc.ExternalProcessorStub, key: str) -> tuple[int, dict[str, str]]:
    """One chat request's admission stream, ended by Envoy after the decision: the status of
    an immediate answer (0 for a forward) and its headers."""
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", "/v1/chat/completions", key))
    reply = await peer.send(body_message(chat_body()))
    await peer.close()
    await peer.call.code()
    if reply.WhichOneof("response") != "immediate_response":
        return 0, {}
    answer = reply.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in answer.headers.set_headers}
    return answer.status.code, headers


async def test_a_429_is_kept_with_its_retry_after_and_the_identified_tenant(
    service: Service,
) -> None:
    gateway, stub = service
    assert gateway.recent_rejections() == []
    assert (await chat(stub, TEST_KEYS["initech"]))[0] == 0  # the minute's one request
    status, headers = await chat(stub, TEST_KEYS["initech"])
    assert status == 429
    retry_after = int(headers["retry-after"])
    assert retry_after >= 1
    (newest,) = gateway.recent_rejections()
    assert newest["at"] is not None
    assert {k: v for k, v in newest.items() if k not in ("at", "message")} == {
        "tenant": "initech", "tier": "standard", "pool": "short", "outcome": "rejected_rate",
        "status": 429, "retry_after_s": retry_after, "code": "rejected_rate",
    }  # fmt: skip
    assert isinstance(newest["message"], str) and newest["message"]


async def test_an_unidentified_request_is_kept_without_the_tenant_it_claimed(
    service: Service,
) -> None:
    gateway, stub = service
    key = "sk-not-a-key-of-anyone"
    claims = [("x-tenant-id", "acme"), ("x-tier", "premium")]
    peer = EnvoyPeer(stub)
    reply = await peer.send(
        headers_message("POST", "/v1/chat/completions?api_key=sk-query-secret", key, claims)
    )
    assert reply.immediate_response.status.code == 401
    await peer.close()
    await peer.call.code()
    (newest,) = gateway.recent_rejections()
    assert (newest["tenant"], newest["tier"], newest["pool"]) == (None, None, None)
    assert (newest["status"], newest["outcome"], newest["retry_after_s"]) == (
        401, "unauthorized", None,
    )  # fmt: skip
    text = orjson.dumps(newest).decode()
    assert key not in text and "sk-query-secret" not in text and "?api_key=" not in text


async def test_the_ring_keeps_the_last_rejections_newest_first(service: Service) -> None:
    gateway, stub = service
    kept = request_record.REJECTIONS_KEPT
    for index in range(kept + 3):
        peer = EnvoyPeer(stub)
        reply = await peer.send(headers_message("GET", f"/v1/nowhere-{index}", None, eos=True))
        assert reply.immediate_response.status.code == 404
        await peer.close()
        await peer.call.code()
    assert (await chat(stub, TEST_KEYS["initech"]))[0] == 0
    assert (await chat(stub, TEST_KEYS["initech"]))[0] == 429
    ring = gateway.recent_rejections()
    assert len(ring) == kept
    assert [r["status"] for r in ring[:2]] == [429, 404]
    assert all(r["status"] == 404 and r["tenant"] is None for r in ring[1:])
    times = [float(str(r["at"])) for r in ring]
    assert times == sorted(times, reverse=True)
    # The path is not part of the record (a 404's path is the client's own text).
    assert all("nowhere" not in str(r["message"]) for r in ring)


def inter_token_quantile(gateway: Gateway, q: float) -> float | None:
    buckets = histogram_buckets(gateway.metrics.inter_token, ("tenant", "pool"))
    return quantile(q, buckets[("acme", "short")])


def test_the_weighted_histogram_exposes_what_a_prometheus_histogram_would() -> None:
    """Same bounds, same observations (a weight of n is n observations): the same samples."""
    ours = WeightedHistogram(
        "gap_seconds", "d", ["tenant"], (0.001, 0.01, 0.1), CollectorRegistry()
    )
    theirs = Histogram("gap_seconds", "d", ["tenant"], buckets=(0.001, 0.01, 0.1),
                       registry=CollectorRegistry())  # fmt: skip
    for value, weight in ((0.001, 1), (0.005, 3), (0.01, 2), (0.5, 1), (0.0001, 4)):
        ours("acme").observe(value, weight)
        for _ in range(weight):
            theirs.labels("acme").observe(value)

    def samples(collected: Iterable[Metric]) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for family in collected
            for s in family.samples
            if not s.name.endswith("_created")
        }

    mine, reference = samples(ours.collect()), samples(theirs.collect())
    assert mine.keys() == reference.keys()
    for key, value in reference.items():
        assert mine[key] == pytest.approx(value), key


class SteppedClock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def sse(*contents: str) -> bytes:
    events = [{"choices": [{"index": 0, "delta": {"content": c}}]} for c in contents]
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


async def test_inter_token_gaps_are_observed_per_output_chunk_divided_by_its_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway = compose(policy_from_text(policy_yaml()))
    clock = SteppedClock()
    monkeypatch.setattr(
        request_record, "time", types.SimpleNamespace(monotonic=clock, time=lambda: 1.7e9)
    )
    admission = AdmissionProcessor(gateway)
    admission.on_request_headers(
        http_headers([(":method", "POST"), (":path", "/v1/chat/completions"),
                      ("authorization", f"Bearer {TEST_KEYS['acme']}")])
    )  # fmt: skip
    replies = [r async for r in admission.on_request_body(HttpBody(body=chat_body()))]
    assert replies[-1].HasField("request_body")
    accounting = AccountingProcessor(gateway)
    accounting.on_request_headers(http_headers([(GATEWAY_REQUEST_ID_HEADER, admission.request_id)]))
    accounting.on_response_headers(
        http_headers([(":status", "200"), ("content-type", "text/event-stream")])
    )

    def observed() -> tuple[float, float]:
        (family,) = gateway.metrics.inter_token.collect()
        samples = {s.name: s.value for s in family.samples if s.labels["tenant"] == "acme"}
        return samples["extproc_inter_token_seconds_count"], samples[
            "extproc_inter_token_seconds_sum"
        ]

    accounting.on_response_body(HttpBody(body=sse("Hel")))  # the first token: no gap yet
    assert observed() == (0.0, 0.0)
    clock.t += 0.030
    accounting.on_response_body(HttpBody(body=sse("lo", " wor")))  # two tokens, 30 ms later
    clock.t += 0.005
    accounting.on_response_body(HttpBody(body=b": keep-alive\n\n"))  # no output: no observation
    clock.t += 0.015
    accounting.on_response_body(HttpBody(body=sse("ld")))  # 20 ms after the last output
    count, total = observed()
    assert count == 3  # weighted by tokens: 15 ms twice, then 20 ms once
    assert total == pytest.approx(0.030 + 0.020)
    assert inter_token_quantile(gateway, 0.5) == pytest.approx(0.015, abs=0.0051)
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}
    clock.t += 0.010
    body = b"data: " + orjson.dumps(usage) + b"\n\ndata: [DONE]\n\n"
    accounting.on_response_body(HttpBody(body=body, end_of_stream=True))
    assert observed()[0] == 3  # the usage chunk carries no new output
    # Only tenants of the policy are labels: the metric has acme's child and no other.
    labels = {s.labels["tenant"] for s in gateway.metrics.inter_token.collect()[0].samples}
    assert labels == {"acme"}
    await gateway.close()
