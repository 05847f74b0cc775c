"""The routes and Envoy's own answers in the rendered bootstrap.

Routes are an allowlist: only the inference endpoints the service admits reach the pools, and
only through the admission filter; `GET /v1/models` goes to the smallest pool with the filters
on (the policy does not know the engines' models, and the key is still checked). Everything
else, the engines' `/metrics`, `/health`, `/tokenize` included, gets an OpenAI 404 (a wrong
method a 405) from Envoy itself and never reaches an engine. Paths are matched after the
connection manager normalised them (extproc.envoy_config), so `%69` or `//` tricks land on the
same routes as the plain path.

Every answer Envoy writes itself (no route, wrong method, body too large, upstream down or
timed out, codec errors) is rewritten into the OpenAI error shape with `application/json`.
Answers the ext_proc service writes already carry `application/json` and pass untouched: the
mappers test the *response's* content type (a CEL filter), not the request's.
"""

from __future__ import annotations

from datetime import timedelta

from envoy_data_plane.envoy.config.accesslog.v3 import (
    AccessLogFilter,
    AndFilter,
    ComparisonFilter,
    ComparisonFilterOp,
    ExtensionFilter,
    StatusCodeFilter,
)
from envoy_data_plane.envoy.config.core.v3 import (
    DataSource,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    RuntimeUInt32,
    SubstitutionFormatString,
)
from envoy_data_plane.envoy.config.route.v3 import (
    DirectResponseAction,
    HeaderMatcher,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter
from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer, BufferPerRoute
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExtProcOverrides,
    ExtProcPerRoute,
)
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    LocalReplyConfig,
    ResponseMapper,
)
from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
from envoy_data_plane.envoy.type.v3 import Int64Range
from envoy_data_plane.google.protobuf import Any as AnyProto
from envoy_data_plane.google.protobuf import Struct
from orjson import dumps

from extproc.endpoints import ENDPOINTS
from extproc.errors import http_answer, too_large
from extproc.openai_request import INFERENCE_PATHS
from extproc.policy import Policy
from extproc.scheduler import retry_after
from extproc.types import POOL_HEADER, REPLICA_HEADER, UPSTREAM_HEADER

MODELS_PATH = "/v1/models"
ADMISSION_FILTER = "extproc.admission"
ACCOUNTING_FILTER = "extproc.accounting"
DRAIN_FILTER = "extproc.drain_oversized"
DRAIN_MIN_BYTES = 32 * 1024 * 1024
"""A body declared above the limit is read whole before its 413 up to this size (or twice the
limit, if larger): see `_oversized`."""
_JSON = "application/json"
_NOT_JSON_RESPONSE = (
    "!('content-type' in response.headers) || "
    f"!response.headers['content-type'].startsWith('{_JSON}')"
)
_CEL_FILTER = "envoy.access_loggers.extension_filters.cel"
_ADMISSION_TOO_LATE = "response.code_details.startsWith('ext_proc_error_per-message_timeout')"

# (status, message, type, code) for each answer Envoy may write itself.
_ENVOY_ANSWERS = (
    (400, "the request is malformed", "invalid_request_error", "bad_request"),
    (404, "not found", "invalid_request_error", "not_found"),
    (405, "method not allowed", "invalid_request_error", "method_not_allowed"),
    (408, "request timed out", "invalid_request_error", "request_timeout"),
    (413, "request body too large", "invalid_request_error", "body_too_large"),
    (429, "too many requests", "rate_limit_error", "rate_limited"),
    (431, "request headers too large", "invalid_request_error", "headers_too_large"),
    (500, "gateway error", "api_error", "gateway_error"),
    (502, "upstream error", "api_error", "upstream_error"),
    (
        503,
        "unavailable, retry shortly: %RESPONSE_CODE_DETAILS%",
        "service_unavailable",
        "unavailable",
    ),
    (504, "upstream timed out", "service_unavailable", "upstream_timeout"),
)


def openai_error(message: str, error_type: str, code: str) -> dict[str, object]:
    return {"error": {"message": message, "type": error_type, "code": code, "param": None}}


def _json_format(body: dict[str, object]) -> SubstitutionFormatString:
    return SubstitutionFormatString(json_format=Struct.from_dict(body), content_type=_JSON)


def _status_is(status: int) -> AccessLogFilter:
    return AccessLogFilter(
        status_code_filter=StatusCodeFilter(
            comparison=ComparisonFilter(
                op=ComparisonFilterOp.EQ,
                value=RuntimeUInt32(
                    default_value=status, runtime_key=f"extproc.local_reply.{status}"
                ),
            )
        )
    )


def _response_not_json() -> AccessLogFilter:
    return _cel(_NOT_JSON_RESPONSE)


def _cel(expression: str) -> AccessLogFilter:
    cel = ExpressionFilter(expression=expression)
    return AccessLogFilter(
        extension_filter=ExtensionFilter(name=_CEL_FILTER, typed_config=AnyProto.pack(cel))
    )


def _admission_too_late() -> ResponseMapper:
    """Envoy answers 504 when the admission service misses `message_timeout` (its CPU
    saturated, say). No engine was asked: the gateway is overloaded, so the client gets a 503
    with Retry-After, as the service's own overload answers do, not "upstream timed out"."""
    return ResponseMapper(
        filter=AccessLogFilter(
            and_filter=AndFilter(filters=[_cel(_ADMISSION_TOO_LATE), _response_not_json()])
        ),
        status_code=503,
        body_format_override=_json_format(
            openai_error(
                "the gateway is overloaded, retry shortly", "service_unavailable", "overloaded"
            )
        ),
        headers_to_add=_retry_after(),
    )


def _retry_after() -> list[HeaderValueOption]:
    """Envoy's own 503s (the service down, say: the admission filter's status_on_error, or
    no healthy engine) tell the client when to come back."""
    return [_add_header("retry-after", str(retry_after.GATEWAY_UNAVAILABLE_S))]


def local_replies() -> LocalReplyConfig:
    """Known statuses get their own type and code; any other non-JSON answer the last one."""
    mappers = [_admission_too_late()]
    mappers += [
        ResponseMapper(
            filter=AccessLogFilter(
                and_filter=AndFilter(filters=[_status_is(status), _response_not_json()])
            ),
            body_format_override=_json_format(openai_error(message, error_type, code)),
            headers_to_add=_retry_after() if status == 503 else [],
        )
        for status, message, error_type, code in _ENVOY_ANSWERS
    ]
    mappers.append(
        ResponseMapper(
            filter=_response_not_json(),
            body_format_override=_json_format(
                openai_error("gateway error: %RESPONSE_CODE_DETAILS%", "api_error", "gateway_error")
            ),
        )
    )
    return LocalReplyConfig(mappers=mappers)


def _method_is(method: str) -> HeaderMatcher:
    return HeaderMatcher(name=":method", string_match=StringMatcher(exact=method))


def _add_header(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=name, value=value),
        append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def _filters_on(extproc_filters: bool) -> dict[str, AnyProto]:
    """The ext_proc filters are off by default (extproc.envoy_config) and on for the routes to
    the pools. Off elsewhere, Envoy's own answers go out without waiting for the service: with
    them on, a codec error's 400 waited for a response-headers round trip that the closing
    connection cut, and the client got no answer at all."""
    if not extproc_filters:
        return {}
    # Envoy refuses an empty per-route config; empty overrides change nothing.
    on = AnyProto.pack(ExtProcPerRoute(overrides=ExtProcOverrides()))
    return {ADMISSION_FILTER: on, ACCOUNTING_FILTER: on}


def _answer(
    match: RouteMatch, status: int, error: dict[str, object], extra: list[HeaderValueOption]
) -> Route:
    return Route(
        match=match,
        direct_response=DirectResponseAction(
            status=status, body=DataSource(inline_string=dumps(error).decode())
        ),
        response_headers_to_add=[_add_header("content-type", _JSON), *extra],
    )


def _not_found() -> Route:
    paths = " or ".join(f"POST {p}" for p in INFERENCE_PATHS)
    error = openai_error(
        f"no such endpoint: this gateway serves {paths} and GET {MODELS_PATH}",
        "invalid_request_error", "not_found",
    )  # fmt: skip
    return _answer(RouteMatch(prefix="/"), 404, error, [])


def _wrong_method(path: str, allowed: str) -> Route:
    error = openai_error(
        f"{path} accepts {allowed} only", "invalid_request_error", "method_not_allowed"
    )
    allow = [_add_header("allow", allowed)]
    return _answer(RouteMatch(path=path), 405, error, allow)


def drain_limit(max_body_bytes: int) -> int:
    return max(DRAIN_MIN_BYTES, 2 * max_body_bytes)


def _oversized(max_body_bytes: int) -> Route:
    """A body whose content-length is above the limit: read it whole, then answer 413.

    Answered early, the 413 is followed by a close without reading the rest (Envoy does not
    drain unread request bodies, envoyproxy/envoy#36080), and a client that writes the whole
    body before reading (Python's http.client) gets a connection reset once the body outgrows
    the socket buffers. Here the buffer filter (off elsewhere, extproc.envoy_config) takes in
    the whole body first; the direct answer then comes after the request, which the client
    reads. The cost is buffering up to `drain_limit` bytes per such request: a larger declared
    body is refused early by the admission stream, as a chunked one past the limit is by the
    admission filter's buffer (docs/deploy.md)."""
    limit = drain_limit(max_body_bytes)
    declared = HeaderMatcher(
        name="content-length", range_match=Int64Range(start=max_body_bytes + 1, end=limit + 1)
    )
    answer = http_answer(too_large(max_body_bytes))
    drain = BufferPerRoute(buffer=Buffer(max_request_bytes=limit))
    return Route(
        match=RouteMatch(prefix="/", headers=[declared]),
        direct_response=DirectResponseAction(
            status=answer.status, body=DataSource(inline_string=answer.body.decode())
        ),
        response_headers_to_add=[_add_header("content-type", _JSON)],
        typed_per_filter_config={DRAIN_FILTER: AnyProto.pack(drain)},
    )


def pool_cluster(pool: str) -> str:
    return f"pool_{pool}"


def replica_cluster(pool: str, replica: int) -> str:
    """The cluster of one endpoint of a pool with several (extproc.envoy_config)."""
    return f"pool_{pool}_replica_{replica}"


def _exact(header: str, value: str) -> HeaderMatcher:
    return HeaderMatcher(name=header, string_match=StringMatcher(exact=value))


def routes(policy: Policy, extproc_filters: bool) -> RouteConfiguration:
    # The accounting stream learns which engine served the response (to correct cut-short
    # streams from its counters, extproc.service.reconcile); the header-mutation filter
    # removes the header before the client sees it (extproc.envoy_config).
    upstream = [_add_header(UPSTREAM_HEADER, "%UPSTREAM_HOST%")] if extproc_filters else []
    smallest = f"pool_{policy.pools_by_size[0][0]}"

    def to_pool(match: RouteMatch, cluster: str) -> Route:
        # timeout 0: long streamed responses must not be cut by the route timeout.
        return Route(
            match=match,
            route=RouteAction(cluster=cluster, timeout=timedelta(0)),
            response_headers_to_add=upstream,
            typed_per_filter_config=_filters_on(extproc_filters),
        )

    table: list[Route] = [_oversized(policy.source.gateway.max_body_bytes)]
    for path in INFERENCE_PATHS:
        # The admission filter sets x-llm-pool and clears the route cache: the second match
        # picks the pool, one that serves the path's class. Before that (and without the
        # filters) the smallest such pool is chosen; with none, the smallest pool: the
        # admission filter answers the request itself (no pool serves it).
        serving = policy.pools_by_class[ENDPOINTS[path]]
        for pool, spec in serving:
            chosen = _exact(POOL_HEADER, pool)
            if extproc_filters and len(spec.endpoints) > 1:
                # The locality index chose the endpoint (fairness dlpm): its own cluster.
                for replica in range(len(spec.endpoints)):
                    on = _exact(REPLICA_HEADER, str(replica))
                    match = RouteMatch(path=path, headers=[_method_is("POST"), chosen, on])
                    table.append(to_pool(match, replica_cluster(pool, replica)))
            match = RouteMatch(path=path, headers=[_method_is("POST"), chosen])
            table.append(to_pool(match, pool_cluster(pool)))
        first = pool_cluster(serving[0][0]) if serving else smallest
        table.append(to_pool(RouteMatch(path=path, headers=[_method_is("POST")]), first))
        table.append(_wrong_method(path, "POST"))
    table.append(to_pool(RouteMatch(path=MODELS_PATH, headers=[_method_is("GET")]), smallest))
    table.append(_wrong_method(MODELS_PATH, "GET"))
    table.append(_not_found())
    return RouteConfiguration(
        name="llm",
        virtual_hosts=[VirtualHost(name="llm", domains=["*"], routes=table)],
        request_headers_to_remove=[],
    )


__all__ = [
    "ACCOUNTING_FILTER",
    "ADMISSION_FILTER",
    "DRAIN_FILTER",
    "MODELS_PATH",
    "drain_limit",
    "local_replies",
    "pool_cluster",
    "replica_cluster",
    "routes",
]
