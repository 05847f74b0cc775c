"""Pieces of Envoy's own API, shared by every kind of file that embeds them."""

from __future__ import annotations

from extproc.envoy_lint.model import (
    Cluster,
    ExtProc,
    GrpcLog,
    HttpFilter,
    Manager,
    Role,
    Route,
    Setting,
)
from extproc.envoy_lint.source import Node, snake_case
from extproc.envoy_lint.values import flag, integer, seconds
from extproc.service.roles import ACCOUNTING_ROLE, ROLE_METADATA
from extproc.types import POOL_HEADER

EXT_PROC_TYPE = "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HCM_TYPE = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HCM_NAME = "envoy.filters.network.http_connection_manager"
HTTP_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
GRPC_LOG_TYPE = "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
GRPC_LOG_NAME = "envoy.access_loggers.http_grpc"


def type_url(config: Node | None) -> str:
    node = config.get("@type") if config is not None else None
    text = node.text() if node is not None else None
    return text or ""


def enum_setting(node: Node | None) -> Setting[str] | None:
    """An enum value, upper-cased as Envoy's proto names are."""
    if node is None or node.text() is None:
        return None
    return Setting(str(node.value).upper(), node.line)


def flag_setting(node: Node | None) -> Setting[bool] | None:
    value = flag(node) if node is not None else None
    return Setting(value, node.line) if node is not None and value is not None else None


def seconds_setting(node: Node | None) -> Setting[float] | None:
    value = seconds(node) if node is not None else None
    return Setting(value, node.line) if node is not None and value is not None else None


def _role_metadata(grpc: Node | None) -> Setting[str] | None:
    metadata = grpc.get("initial_metadata") if grpc is not None else None
    for item in metadata.items() if metadata is not None else []:
        key, value = item.get("key"), item.get("value")
        if key is not None and key.text() == ROLE_METADATA and value is not None:
            return Setting(str(value.value), value.line)
    return None


def ext_proc(name: str, line: int, config: Node) -> ExtProc:
    """An ExternalProcessor typed_config. It is the accounting filter when it runs in
    observability mode or names that role; any other ext_proc filter is taken for admission."""
    grpc = config.get("grpc_service")
    mode = config.get("processing_mode")
    observability = flag_setting(config.get("observability_mode"))
    metadata = _role_metadata(grpc)
    accounting = (observability is not None and observability.value) or (
        metadata is not None and metadata.value == ACCOUNTING_ROLE
    )
    role: Role = "accounting" if accounting else "admission"
    cluster = grpc.at("envoy_grpc", "cluster_name") if grpc is not None else None
    return ExtProc(
        name=name,
        line=line,
        role=role,
        request_header_mode=enum_setting(
            mode.get("request_header_mode") if mode is not None else None
        ),
        request_body_mode=enum_setting(mode.get("request_body_mode") if mode is not None else None),
        response_header_mode=enum_setting(
            mode.get("response_header_mode") if mode is not None else None
        ),
        response_body_mode=enum_setting(
            mode.get("response_body_mode") if mode is not None else None
        ),
        send_body_without_waiting=flag_setting(
            config.get("send_body_without_waiting_for_header_response")
        ),
        observability_mode=observability,
        failure_mode_allow=flag_setting(config.get("failure_mode_allow")),
        message_timeout=seconds_setting(config.get("message_timeout")),
        max_message_timeout=seconds_setting(config.get("max_message_timeout")),
        grpc_timeout=seconds_setting(grpc.get("timeout") if grpc is not None else None),
        role_metadata=metadata,
        cluster=name_setting(cluster),
    )


def grpc_log(entry: Node) -> GrpcLog | None:
    """An access_log entry, if it is a gRPC (HTTP) access log."""
    name, config = entry.get("name"), entry.get("typed_config")
    if not type_url(config).endswith(GRPC_LOG_TYPE) and (
        name is None or name.value != GRPC_LOG_NAME
    ):
        return None
    size = config.at("common_config", "buffer_size_bytes") if config is not None else None
    if size is not None and size.get("value") is not None:  # the wrapper spelled out
        size = size.get("value")
    number = integer(size) if size is not None else None
    return GrpcLog(entry.line, Setting(number, size.line) if size and number is not None else None)


def grpc_logs(access_log: Node | None) -> list[GrpcLog]:
    entries = access_log.items() if access_log is not None else []
    return [log for log in (grpc_log(e) for e in entries) if log is not None]


def name_setting(node: Node | None) -> Setting[str] | None:
    """A name, kept as written (names are case-sensitive)."""
    if node is None or node.text() is None:
        return None
    return Setting(str(node.value), node.line)


def http_filter(entry: Node) -> HttpFilter:
    name_node = entry.get("name")
    name = str(name_node.value) if name_node is not None else ""
    line = name_node.line if name_node is not None else entry.line
    config = entry.get("typed_config")
    disabled = flag_setting(entry.get("disabled"))
    if config is not None and (
        type_url(config).endswith(EXT_PROC_TYPE) or name == "envoy.filters.http.ext_proc"
    ):
        return HttpFilter(name, line, ext_proc(name, line, config), disabled)
    return HttpFilter(name, line, disabled=disabled)


def manager(config: Node) -> Manager:
    return Manager(
        line=config.line,
        stream_idle_timeout=seconds_setting(config.get("stream_idle_timeout")),
        normalize_path=flag_setting(config.get("normalize_path")),
        merge_slashes=flag_setting(config.get("merge_slashes")),
        escaped_slashes_action=enum_setting(config.get("path_with_escaped_slashes_action")),
    )


def _pool_value(matcher: Node) -> str | None:
    name = matcher.get("name")
    if name is None or str(name.value).lower() != POOL_HEADER:
        return None
    for exact in (matcher.at("string_match", "exact"), matcher.get("exact_match")):
        if exact is not None and exact.text() is not None:
            return str(exact.value)
    return None


def disabled_filters(owner: Node) -> tuple[Setting[str], ...]:
    """Filters that `typed_per_filter_config` turns off (ExtProcPerRoute or FilterConfig
    `disabled: true`) on a route or a virtual host."""
    configs = owner.get("typed_per_filter_config")
    found = []
    for name, config in configs.entries() if configs is not None else []:
        disabled = config.get("disabled")
        if disabled is not None and flag(disabled):
            found.append(Setting(name, disabled.line))
    return tuple(found)


def enabled_filters(owner: Node) -> tuple[str, ...]:
    """Filters that `typed_per_filter_config` configures without `disabled: true`."""
    configs = owner.get("typed_per_filter_config")
    found = []
    for name, config in configs.entries() if configs is not None else []:
        disabled = config.get("disabled")
        if disabled is None or not flag(disabled):
            found.append(str(name))
    return tuple(found)


def route(
    entry: Node,
    host_disabled: tuple[Setting[str], ...] = (),
    host_enabled: tuple[str, ...] = (),
) -> Route:
    match = entry.get("match")
    headers = match.get("headers") if match is not None else None
    pools = [p for p in (_pool_value(h) for h in headers.items()) if p] if headers else []
    has_matchers = bool(headers and headers.items()) or (
        match is not None and match.get("query_parameters") is not None
    )
    prefix = match.get("prefix") if match is not None else None
    any_path = match is None or (prefix is not None and prefix.value == "/")
    action = entry.get("route")
    timeout = action.get("timeout") if action is not None else None
    return Route(
        line=entry.line,
        pool=pools[0] if pools else None,
        catch_all=any_path and not has_matchers,
        timeout=seconds_setting(timeout),
        forwards=action is not None,
        disabled_filters=host_disabled + disabled_filters(entry),
        enabled_filters=host_enabled + enabled_filters(entry),
    )


def routes(route_config: Node) -> list[Route]:
    hosts = route_config.get("virtual_hosts")
    found: list[Route] = []
    for host in hosts.items() if hosts is not None else []:
        entries = host.get("routes")
        off, on = disabled_filters(host), enabled_filters(host)
        found += [route(e, off, on) for e in (entries.items() if entries is not None else [])]
    return found


def cluster(entry: Node) -> Cluster:
    name_node = entry.get("name")
    name = str(name_node.value) if name_node is not None else ""
    thresholds: dict[str, Setting[int]] | None = None
    breakers = entry.at("circuit_breakers", "thresholds")
    for threshold in breakers.items() if breakers is not None else []:
        priority = threshold.get("priority")
        if priority is not None and str(priority.value).upper() != "DEFAULT":
            continue
        thresholds = {}
        for key, child in threshold.entries():
            number = integer(child)
            if number is not None:
                thresholds[snake_case(key)] = Setting(number, child.line)
    http2_options = None
    options = entry.get("typed_extension_protocol_options")
    explicit = options.get(HTTP_OPTIONS_KEY) if options is not None else None
    if explicit is not None:
        http2_options = explicit.at("explicit_http_config", "http2_protocol_options")
    if http2_options is None:
        http2_options = entry.get("http2_protocol_options")  # the deprecated field
    keepalive = (
        http2_options.at("connection_keepalive", "interval") if http2_options is not None else None
    )
    return Cluster(
        name=name,
        line=entry.line,
        thresholds=thresholds,
        http2=Setting(True, http2_options.line) if http2_options is not None else None,
        keepalive_interval=seconds_setting(keepalive),
    )
