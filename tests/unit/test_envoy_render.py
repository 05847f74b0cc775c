"""The rendered bootstrap passes the real Envoy's validation (the `dataplane` tests), and envoy/
stays in sync."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.envoy_config import (
    ACCOUNTING_FILTER,
    ADMISSION_FILTER,
    RenderOptions,
    admission_response_headers,
    render_bootstrap,
)
from extproc.envoy_routes import DRAIN_FILTER
from extproc.policy import load_policy, policy_from_text
from extproc.types import OWNED_HEADERS, UPSTREAM_HEADER
from gateway_lab.processes import envoy_binary
from tests.conftest import policy_yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_OPTIONS = RenderOptions(
    listen="0.0.0.0:8080",
    extproc="extproc:50051",
    envoy_events="extproc:50053",
    pool_endpoints={"short": ["engine-short:8000"], "long": ["engine-long:8000"]},
)


def validate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.dataplane
def test_render_passes_envoy_validate(tmp_path: Path) -> None:
    config = tmp_path / "envoy.json"
    config.write_text(render_bootstrap(policy_from_text(policy_yaml()), RenderOptions()))
    result = validate(config)
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_holds_requests_long_enough() -> None:
    policy = policy_from_text(policy_yaml(acme_limits="{max_queue_wait: 2m}"))
    bootstrap = json.loads(render_bootstrap(policy, RenderOptions()))
    manager = bootstrap["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0][
        "typedConfig"
    ]
    strip, admission, accounting, drain, router = manager["httpFilters"]
    removed = [m["remove"] for m in strip["typedConfig"]["mutations"]["requestMutations"]]
    assert set(removed) == set(OWNED_HEADERS)  # before any filter or log reads them
    # The response: the upstream header goes after the accounting filter read it.
    response = strip["typedConfig"]["mutations"]["responseMutations"]
    assert response[0] == {"remove": UPSTREAM_HEADER}
    added = {m["append"]["header"]["key"] for m in response[1:]}
    assert added == set(admission_response_headers())
    assert admission["typedConfig"]["maxMessageTimeout"] == "150s"
    assert admission["typedConfig"]["processingMode"]["responseHeaderMode"] == "SKIP"
    assert accounting["typedConfig"]["observabilityMode"] is True
    assert drain["name"] == DRAIN_FILTER and drain["disabled"] is True
    assert router["name"] == "envoy.filters.http.router"
    (drain_route, *_) = manager["routeConfig"]["virtualHosts"][0]["routes"]
    (declared,) = drain_route["match"]["headers"]
    assert declared["rangeMatch"]["start"] == str(policy.source.gateway.max_body_bytes + 1)
    assert drain_route["directResponse"]["status"] == 413
    assert manager["streamIdleTimeout"] == "180s"
    extproc = bootstrap["staticResources"]["clusters"][0]
    assert extproc["circuitBreakers"]["thresholds"][0]["maxRequests"] >= 100_000


@pytest.mark.dataplane
def test_invalid_bootstrap_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "broken.json"
    config.write_text(json.dumps({"static_resources": {"clusters": [{"name": 1}]}}))
    assert validate(config).returncode != 0


@pytest.mark.dataplane
@pytest.mark.parametrize(
    ("file", "options"), [("envoy.json", RenderOptions()), ("envoy-compose.json", COMPOSE_OPTIONS)]
)
def test_committed_configs_match_render_and_validate(file: str, options: RenderOptions) -> None:
    committed = REPO / "envoy" / file
    fresh = render_bootstrap(load_policy(REPO / "policies" / "default.yaml"), options)
    assert committed.read_text() == fresh, f"re-render envoy/{file} (see envoy/README.md)"
    assert validate(committed).returncode == 0


def test_no_init_py_in_envoy_folder() -> None:
    assert not (REPO / "envoy" / "__init__.py").exists()


def manager_of(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["staticResources"]["listeners"][0]
    return listener["filterChains"][0]["filters"][0]["typedConfig"]  # type: ignore[no-any-return]


def rendered(policy_text: str | None = None) -> dict[str, Any]:
    policy = policy_from_text(policy_text or policy_yaml())
    return json.loads(render_bootstrap(policy, RenderOptions()))  # type: ignore[no-any-return]


def test_paths_are_normalised_and_encoded_slashes_refused() -> None:
    manager = manager_of(rendered())
    assert manager["normalizePath"] is True
    assert manager["mergeSlashes"] is True
    assert manager["pathWithEscapedSlashesAction"] == "REJECT_REQUEST"


def test_routes_are_an_allowlist() -> None:
    """Only the inference endpoints (POST) and GET /v1/models reach a pool, each with the
    admission filter turned on; the last route answers 404 itself."""
    manager = manager_of(rendered())
    routes = manager["routeConfig"]["virtualHosts"][0]["routes"]
    to_pools = [r for r in routes if "route" in r]
    assert {r["match"].get("path") for r in to_pools} == {
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank",
        "/v1/score", "/v1/models",
    }  # fmt: skip
    for route in to_pools:
        methods = [h for h in route["match"]["headers"] if h["name"] == ":method"]
        expected = "GET" if route["match"]["path"] == "/v1/models" else "POST"
        assert methods[0]["stringMatch"]["exact"] == expected
        assert {ADMISSION_FILTER, ACCOUNTING_FILTER} <= set(route["typedPerFilterConfig"])
    last = routes[-1]
    assert last["match"] == {"prefix": "/"} and last["directResponse"]["status"] == 404
    body = json.loads(last["directResponse"]["body"]["inlineString"])
    assert set(body["error"]) == {"message", "type", "code", "param"}
    filters = {f["name"]: f for f in manager["httpFilters"]}
    # Off unless a route turns them on: no route to a pool may exist without them.
    assert filters[ADMISSION_FILTER]["disabled"] is True
    assert filters[ACCOUNTING_FILTER]["disabled"] is True


def test_wrong_method_gets_405_with_allow() -> None:
    routes = manager_of(rendered())["routeConfig"]["virtualHosts"][0]["routes"]
    answers = {
        r["match"].get("path"): r
        for r in routes
        if r.get("directResponse", {}).get("status") == 405
    }
    assert set(answers) == {
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank",
        "/v1/score", "/v1/models",
    }  # fmt: skip
    chat = answers["/v1/chat/completions"]
    added = {h["header"]["key"]: h["header"]["value"] for h in chat["responseHeadersToAdd"]}
    assert added == {"content-type": "application/json", "allow": "POST"}


def test_local_replies_test_the_response_not_the_request() -> None:
    """A mapper keyed on the request's content type skipped every client sending JSON."""
    mappers = manager_of(rendered())["localReplyConfig"]["mappers"]
    assert "headerFilter" not in json.dumps(mappers)
    for mapper in mappers:
        text = json.dumps(mapper["filter"])
        assert "response.headers['content-type']" in text
        body = mapper["bodyFormatOverride"]
        assert body["contentType"] == "application/json"
        assert set(body["jsonFormat"]["error"]) == {"message", "type", "code", "param"}
    statuses = {
        f["statusCodeFilter"]["comparison"]["value"]["defaultValue"]
        for m in mappers
        if "andFilter" in m["filter"]
        for f in m["filter"]["andFilter"]["filters"]
        if "statusCodeFilter" in f
    }
    assert {400, 404, 405, 413, 429, 500, 502, 503, 504} <= statuses
    assert "andFilter" not in mappers[-1]["filter"]  # the catch-all for any other status
    # first: the admission service too late for message_timeout is a 503, not Envoy's 504
    late = mappers[0]
    assert "ext_proc_error_per-message_timeout" in json.dumps(late["filter"])
    assert late["statusCode"] == 503
    assert late["bodyFormatOverride"]["jsonFormat"]["error"]["code"] == "overloaded"
    assert [h["header"]["key"] for h in late["headersToAdd"]] == ["retry-after"]


def test_listener_refuses_port_reuse() -> None:
    listener = rendered()["staticResources"]["listeners"][0]
    assert listener["enableReusePort"] is False


def test_access_log_path_has_no_query_string() -> None:
    log = manager_of(rendered())["accessLog"][0]["typedConfig"]["logFormat"]
    assert log["jsonFormat"]["path"] == "%REQ_WITHOUT_QUERY(:PATH)%"
    assert "%REQ(:PATH)%" not in json.dumps(log)


def test_explicit_max_message_timeout_is_rendered() -> None:
    bootstrap = rendered(policy_yaml(extra="gateway: {max_message_timeout: 10m}"))
    admission = manager_of(bootstrap)["httpFilters"][1]
    assert admission["name"] == ADMISSION_FILTER
    assert admission["typedConfig"]["maxMessageTimeout"] == "600s"
    assert admission["typedConfig"]["grpcService"]["timeout"] == "600s"
    assert manager_of(bootstrap)["streamIdleTimeout"] == "630s"


def cluster_of(http_filter: dict[str, Any]) -> str:
    return str(http_filter["typedConfig"]["grpcService"]["envoyGrpc"]["clusterName"])


def test_accounting_gets_its_own_cluster_when_asked() -> None:
    """`--accounting`: the accounting filter names a cluster of its own (the service's child
    process, `serve --accounting-grpc`); admission stays on the ext_proc cluster."""
    policy = policy_from_text(policy_yaml())
    for accounting, expected in ((None, "extproc"), ("127.0.0.1:50061", "extproc_accounting")):
        bootstrap = json.loads(render_bootstrap(policy, RenderOptions(accounting=accounting)))
        manager = bootstrap["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0][
            "typedConfig"
        ]
        _, admission, accounting_filter, *_ = manager["httpFilters"]
        assert cluster_of(admission) == "extproc"
        assert cluster_of(accounting_filter) == expected
        clusters = {c["name"]: c for c in bootstrap["staticResources"]["clusters"]}
        assert ("extproc_accounting" in clusters) == (accounting is not None)
        if accounting is not None:
            own = clusters["extproc_accounting"]
            assert own["circuitBreakers"]["thresholds"][0]["maxRequests"] >= 100_000
            assert "typedExtensionProtocolOptions" in own  # HTTP/2, like every gRPC cluster


def test_several_workers_each_get_their_events_and_ends() -> None:
    """`serve --workers 2 --worker-ports distinct --envoy-events`: one events cluster and one
    access log per worker, so Envoy sends each request's counting to its admitting worker."""
    options = RenderOptions(
        extproc="127.0.0.1:7000,127.0.0.1:7001", envoy_events="127.0.0.1:7100,127.0.0.1:7101"
    )
    bootstrap = json.loads(render_bootstrap(policy_from_text(policy_yaml()), options))
    clusters = {
        c["name"]: [
            e["endpoint"]["address"]["socketAddress"]["portValue"]
            for e in c["loadAssignment"]["endpoints"][0]["lbEndpoints"]
        ]
        for c in bootstrap["staticResources"]["clusters"]
    }
    assert clusters["extproc"] == [7000, 7001]  # admission spreads over both
    assert clusters["extproc_events_0"] == [7100] and clusters["extproc_events_1"] == [7101]
    assert clusters["extproc_worker_0"] == [7000] and clusters["extproc_worker_1"] == [7001]
    assert "extproc_events" not in clusters
    manager = bootstrap["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0][
        "typedConfig"
    ]
    ends = [
        (
            log["filter"]["metadataFilter"]["matcher"],
            log["typedConfig"]["commonConfig"]["grpcService"]["envoyGrpc"]["clusterName"],
        )
        for log in manager["accessLog"]
        if log["name"] == "envoy.access_loggers.http_grpc"
    ]
    assert [(m["path"][0]["key"], m["value"]["stringMatch"]["exact"], c) for m, c in ends] == [
        ("worker", "0", "extproc_worker_0"),
        ("worker", "1", "extproc_worker_1"),
    ]
    lua = next(f for f in manager["httpFilters"] if f["name"] == "extproc.counting")
    assert "local WORKERS = 2" in lua["typedConfig"]["defaultSourceCode"]["inlineString"]
    unpaired = RenderOptions(extproc="127.0.0.1:7000", envoy_events=options.envoy_events)
    with pytest.raises(ValueError, match="needs as many ext_proc addresses"):
        render_bootstrap(policy_from_text(policy_yaml()), unpaired)


def test_a_stream_refused_by_one_service_process_is_opened_on_another() -> None:
    """A worker that crashed refuses connections until its restart: with several service
    processes Envoy opens the admission stream on another instead of answering 503. Only
    refusals before the service read anything are retried, so a request is never decided
    twice. One process has no other to try; the accounting stream is never retried (Envoy
    would keep a copy of every response chunk sent on it)."""
    policy = policy_from_text(policy_yaml())

    def retries(options: RenderOptions) -> dict[str, Any]:
        manager = manager_of(json.loads(render_bootstrap(policy, options)))
        found = {}
        for f in manager["httpFilters"]:
            if f["name"] in (ADMISSION_FILTER, ACCOUNTING_FILTER):
                found[f["name"]] = f["typedConfig"]["grpcService"].get("retryPolicy")
        return found

    workers = RenderOptions(
        extproc="127.0.0.1:7000,127.0.0.1:7001", envoy_events="127.0.0.1:7100,127.0.0.1:7101"
    )
    retry = retries(workers)[ADMISSION_FILTER]
    assert set(retry["retryOn"].split(",")) == {"connect-failure", "refused-stream"}
    (predicate,) = retry["retryHostPredicate"]
    assert predicate["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert int(retry["numRetries"]) >= 1
    assert retries(RenderOptions()) == {ADMISSION_FILTER: None, ACCOUNTING_FILTER: None}
    shared = retries(RenderOptions(extproc="127.0.0.1:7000,127.0.0.1:7001"))
    assert shared[ADMISSION_FILTER] == retry and shared[ACCOUNTING_FILTER] is None
    assert retries(RenderOptions(stream_retry=True))[ADMISSION_FILTER] == retry  # a mesh's
    extproc = json.loads(render_bootstrap(policy, workers))["staticResources"]["clusters"][0]
    assert extproc["circuitBreakers"]["thresholds"][0]["maxRetries"] >= 100_000


def test_workers_health_is_checked_on_their_admin_port_when_given() -> None:
    """`--extproc-health` (what `extproc up --workers N` renders): Envoy asks each worker's
    /healthz on its admin address, so a hung one gets no new stream; without it, no check."""
    policy = policy_from_text(policy_yaml())
    plain = json.loads(
        render_bootstrap(policy, RenderOptions(extproc="127.0.0.1:7000,127.0.0.1:7001"))
    )
    assert "healthChecks" not in plain["staticResources"]["clusters"][0]
    options = RenderOptions(
        extproc="127.0.0.1:7000,127.0.0.1:7001", extproc_health="127.0.0.1:9000,127.0.0.1:9001"
    )
    extproc = json.loads(render_bootstrap(policy, options))["staticResources"]["clusters"][0]
    assert extproc["name"] == "extproc"
    (check,) = extproc["healthChecks"]
    assert check["httpHealthCheck"]["path"] == "/healthz"
    assert check["unhealthyThreshold"] == 2 and check["interval"] == "1s"
    assert extproc["commonLbConfig"]["updateMergeWindow"] == "0s"  # verdicts apply at once
    checked = [
        (
            e["endpoint"]["address"]["socketAddress"]["portValue"],
            e["endpoint"]["healthCheckConfig"]["address"]["socketAddress"]["portValue"],
        )
        for e in extproc["loadAssignment"]["endpoints"][0]["lbEndpoints"]
    ]
    assert checked == [(7000, 9000), (7001, 9001)]
    with pytest.raises(ValueError, match="2 endpoints but 1 health addresses"):
        render_bootstrap(
            policy, RenderOptions(extproc=options.extproc, extproc_health="127.0.0.1:9000")
        )
