"""Envoy Gateway: EnvoyExtensionPolicy (the admission filter), EnvoyPatchPolicy (what that
API cannot say, as JSON patches), HTTPRoute (the pool routes) and ClientTrafficPolicy (the
body limit, path handling). All such documents of a file make one view.
"""

from __future__ import annotations

from extproc.envoy_lint.kinds import envoy_api
from extproc.envoy_lint.model import Cluster, ExtProc, HttpFilter, Manager, Route, Setting, View
from extproc.envoy_lint.source import Node, snake_case
from extproc.envoy_lint.values import byte_count, integer
from extproc.types import POOL_HEADER

KINDS = ("EnvoyExtensionPolicy", "EnvoyPatchPolicy", "HTTPRoute", "ClientTrafficPolicy")
DEFAULT_BUFFER_LIMIT = 32 * 1024
"""Envoy Gateway's connection buffer limit when a ClientTrafficPolicy sets none."""
SPELLING = {
    "per_connection_buffer_limit_bytes": "ClientTrafficPolicy connection.bufferLimit",
    "path_with_escaped_slashes_action": "ClientTrafficPolicy path.escapedSlashesAction",
    "merge_slashes": "ClientTrafficPolicy path.disableMergeSlashes: false",
    "circuit_breakers": "backendSettings.circuitBreaker maxConnections, maxPendingRequests and "
    "maxParallelRequests",
}
_MANAGER_FIELDS = (
    "stream_idle_timeout",
    "normalize_path",
    "merge_slashes",
    "path_with_escaped_slashes_action",
)
_CIRCUIT_BREAKERS = {
    "max_connections": "max_connections",
    "max_pending_requests": "max_pending_requests",
    "max_parallel_requests": "max_requests",
}
_BODY_MODES = {
    "Buffered": "BUFFERED",
    "Streamed": "STREAMED",
    "BufferedPartial": "BUFFERED_PARTIAL",
}
_ESCAPED_SLASHES = {
    "KeepUnchanged": "KEEP_UNCHANGED",
    "RejectRequest": "REJECT_REQUEST",
    "UnescapeAndRedirect": "UNESCAPE_AND_REDIRECT",
    "UnescapeAndForward": "UNESCAPE_AND_FORWARD",
}


def kind_of(document: Node) -> str | None:
    kind = document.get("kind")
    text = kind.text() if kind is not None else None
    return text if text in KINDS else None


def _mode(direction: Node | None, line: int) -> tuple[Setting[str], Setting[str]]:
    """(headers, body) modes: a direction that is present sends its headers."""
    if direction is None:
        return Setting("SKIP", line), Setting("NONE", line)
    body = direction.get("body")
    body_mode = _BODY_MODES.get(str(body.value), str(body.value).upper()) if body else "NONE"
    return Setting("SEND", direction.line), Setting(body_mode, body.line if body else line)


def _extension(document: Node, entry: Node, index: int) -> tuple[ExtProc, Cluster]:
    name_node = document.at("metadata", "name")
    name = f"{name_node.value if name_node is not None else 'EnvoyExtensionPolicy'}[{index}]"
    mode = entry.get("processing_mode")
    request_headers, request_body = _mode(mode.get("request") if mode else None, entry.line)
    response_headers, response_body = _mode(mode.get("response") if mode else None, entry.line)
    filter_ = ExtProc(
        name=name,
        line=entry.line,
        role="admission",
        request_header_mode=request_headers,
        request_body_mode=request_body,
        response_header_mode=response_headers,
        response_body_mode=response_body,
        failure_mode_allow=envoy_api.flag_setting(entry.get("fail_open")),
        message_timeout=envoy_api.seconds_setting(entry.get("message_timeout")),
        max_message_timeout_settable=False,
    )
    breaker = entry.at("backend_settings", "circuit_breaker")
    thresholds: dict[str, Setting[int]] | None = None
    if breaker is not None:
        thresholds = {}
        for key, child in breaker.entries():
            number, envoy_name = integer(child), _CIRCUIT_BREAKERS.get(snake_case(key))
            if envoy_name is not None and number is not None:
                thresholds[envoy_name] = Setting(number, child.line)
    # Envoy Gateway always speaks HTTP/2 (gRPC) to an ext_proc backend.
    cluster = Cluster(name, entry.line, thresholds, http2=Setting(True, entry.line))
    return filter_, cluster


def _pool_value(matcher: Node) -> str | None:
    """The pool an HTTPRoute header match selects (type Exact, the default)."""
    name, value, kind = matcher.get("name"), matcher.get("value"), matcher.get("type")
    if name is None or str(name.value).lower() != POOL_HEADER or value is None:
        return None
    return str(value.value) if kind is None or kind.value == "Exact" else None


def _http_route(rule: Node) -> list[Route]:
    timeout = envoy_api.seconds_setting(rule.at("timeouts", "request"))
    forwards = rule.get("backend_refs") is not None
    matches = rule.get("matches")
    routes = []
    for match in matches.items() if matches is not None else []:
        headers = match.get("headers")
        pools = [p for p in (_pool_value(h) for h in headers.items()) if p] if headers else []
        path = match.at("path", "value")
        any_path = path is None or path.value == "/"
        catch_all = any_path and headers is None and match.get("query_params") is None
        routes.append(Route(match.line, pools[0] if pools else None, catch_all, timeout, forwards))
    if not routes:
        routes.append(Route(rule.line, None, True, timeout, forwards))
    return routes


class _Patches:
    """Replays the listener patches of EnvoyPatchPolicies onto the filter chain."""

    def __init__(self, result: View, chain: list[HttpFilter]) -> None:
        self.result = result
        self.chain: list[HttpFilter] | None = chain
        self.fields: dict[str, Node] = {}

    def apply(self, operation: Node) -> None:
        op_node, path_node = operation.get("op"), operation.get("path")
        op = str(op_node.value) if op_node is not None else ""
        path = str(path_node.value) if path_node is not None else ""
        where = operation.get("json_path")
        target = path or (str(where.value) if where is not None else "")
        value = operation.get("value")
        if op == "remove" and "envoy.filters.http.router" in target:
            if self.chain is not None:
                self.chain = [f for f in self.chain if not f.is_router]
            return
        if op not in ("add", "replace") or value is None:
            return
        segments = target.strip("/").split("/")
        if "http_filters" in segments and value.is_map:
            entry = envoy_api.http_filter(value)
            if entry.ext_proc is not None:
                self.result.ext_procs.append(entry.ext_proc)
            if self.chain is not None and segments[-1] == "-":
                self.chain.append(entry)
            else:
                self.chain = None
        elif "access_log" in segments and value.is_map:
            found = envoy_api.grpc_log(value)
            self.result.grpc_logs = (self.result.grpc_logs or []) + ([found] if found else [])
        elif segments[-1] in _MANAGER_FIELDS:
            self.fields[segments[-1]] = value
        elif segments[-1] == "per_connection_buffer_limit_bytes":
            number = integer(value)
            if number is not None:
                self.result.buffer_limit = Setting(number, value.line)
                self.result.buffer_limit_shown = True


def _client_policy(document: Node, result: View, fields: dict[str, Node]) -> None:
    limit = document.at("spec", "connection", "buffer_limit")
    number = byte_count(limit) if limit is not None else None
    if limit is not None and number is not None:
        result.buffer_limit = Setting(number, limit.line)
    result.buffer_limit_shown = True
    path = document.at("spec", "path")
    action = path.get("escaped_slashes_action") if path is not None else None
    if action is not None:
        fields["path_with_escaped_slashes_action"] = action
    merge_off = path.get("disable_merge_slashes") if path is not None else None
    if merge_off is not None and isinstance(merge_off.value, bool):
        fields["merge_slashes"] = Node(not merge_off.value, merge_off.line)


def view(documents: list[tuple[str, Node]]) -> View:
    result = View(
        line=documents[0][1].line,
        complete=False,
        default_buffer_limit=DEFAULT_BUFFER_LIMIT,
        spelling=SPELLING,
    )
    # Envoy Gateway puts the EnvoyExtensionPolicy's filters before its router.
    chain: list[HttpFilter] = []
    for kind, document in documents:
        entries = document.at("spec", "ext_proc")
        for index, entry in enumerate(
            entries.items() if kind == "EnvoyExtensionPolicy" and entries else []
        ):
            filter_, cluster = _extension(document, entry, index)
            result.ext_procs.append(filter_)
            chain.append(HttpFilter(filter_.name, entry.line, filter_))
            result.implied_cluster = cluster
    chain.append(HttpFilter("envoy.filters.http.router", 0))
    patches = _Patches(result, chain)
    for kind, document in documents:
        if kind == "EnvoyPatchPolicy":
            entries = document.at("spec", "json_patches")
            for entry in entries.items() if entries is not None else []:
                operation = entry.get("operation")
                if operation is not None:
                    patches.apply(operation)
        elif kind == "ClientTrafficPolicy":
            _client_policy(document, result, patches.fields)
        elif kind == "HTTPRoute":
            rules = document.at("spec", "rules")
            found = [r for rule in (rules.items() if rules else []) for r in _http_route(rule)]
            result.routes = (result.routes or []) + found
    result.filters = patches.chain
    result.manager = _manager(result.line, patches.fields)
    return result


def _manager(line: int, fields: dict[str, Node]) -> Manager:
    action = fields.get("path_with_escaped_slashes_action")
    action_setting = (
        Setting(_ESCAPED_SLASHES.get(str(action.value), str(action.value).upper()), action.line)
        if action is not None
        else None
    )
    return Manager(
        line=line,
        stream_idle_timeout=envoy_api.seconds_setting(fields.get("stream_idle_timeout")),
        normalize_path=envoy_api.flag_setting(fields.get("normalize_path")),
        merge_slashes=envoy_api.flag_setting(fields.get("merge_slashes")),
        escaped_slashes_action=action_setting,
        # Envoy Gateway normalises paths, merges slashes and unescapes-and-redirects by default.
        safe_path_defaults=True,
    )
