"""Istio: the EnvoyFilter patches applied to the ingress gateway's Envoy, with the
VirtualService and DestinationRule they rely on.

All such documents of a file make one view. Filters inserted before the router keep
their patch order; the HCM and listener settings are MERGE patches, so what they leave out is
set (or not) elsewhere and is reported as a note.
"""

from __future__ import annotations

from extproc.envoy_lint.kinds import envoy_api, istio_traffic
from extproc.envoy_lint.model import HttpFilter, Setting, View
from extproc.envoy_lint.source import Node
from extproc.envoy_lint.values import integer

KINDS = ("EnvoyFilter", "VirtualService", "DestinationRule")
ROUTER = "envoy.filters.http.router"


def kind_of(document: Node) -> str | None:
    kind = document.get("kind")
    api = document.get("api_version")
    if kind is None or api is None or not str(api.value).startswith("networking.istio.io/"):
        return None
    return str(kind.value) if kind.value in KINDS else None


def _subfilter(patch: Node) -> str | None:
    name = patch.at("match", "listener", "filter_chain", "filter", "sub_filter", "name")
    return name.text() if name is not None else None


def view(documents: list[tuple[str, Node]]) -> View:
    first: list[HttpFilter] = []
    before_router: list[HttpFilter] = []
    after_router: list[HttpFilter] = []
    order_known = True
    result = View(line=documents[0][1].line, complete=False)
    for document in (d for kind, d in documents if kind == "EnvoyFilter"):
        patches = document.at("spec", "config_patches")
        for patch in patches.items() if patches is not None else []:
            apply_to = patch.get("apply_to")
            operation = patch.at("patch", "operation")
            value = patch.at("patch", "value")
            if apply_to is None or operation is None or value is None:
                continue
            target, op = str(apply_to.value), str(operation.value)
            if target == "HTTP_FILTER":
                entry = envoy_api.http_filter(value)
                if op == "INSERT_BEFORE" and _subfilter(patch) == ROUTER:
                    before_router.append(entry)
                elif op == "INSERT_FIRST":
                    first.append(entry)
                elif op == "ADD":
                    after_router.append(entry)
                else:
                    order_known = False
                if entry.ext_proc is not None:
                    result.ext_procs.append(entry.ext_proc)
            elif target == "NETWORK_FILTER" and op == "MERGE":
                config = value.get("typed_config")
                if config is not None and envoy_api.type_url(config).endswith(envoy_api.HCM_TYPE):
                    result.manager = envoy_api.manager(config)
                    logs = config.get("access_log")
                    if logs is not None:  # MERGE appends them to the gateway's own
                        result.grpc_logs = (result.grpc_logs or []) + envoy_api.grpc_logs(logs)
            elif target == "LISTENER" and op == "MERGE":
                limit = value.get("per_connection_buffer_limit_bytes")
                number = integer(limit) if limit is not None else None
                if limit is not None and number is not None:
                    result.buffer_limit = Setting(number, limit.line)
                    result.buffer_limit_shown = True
    if order_known and result.ext_procs:
        result.filters = [*first, *before_router, HttpFilter(ROUTER, 0), *after_router]
    _traffic(result, documents)
    return result


def _traffic(result: View, documents: list[tuple[str, Node]]) -> None:
    """Routes from VirtualServices; the ext_proc cluster from the DestinationRule for its host."""
    for kind, document in documents:
        if kind == "VirtualService":
            result.routes = (result.routes or []) + istio_traffic.routes(document)
    names = {f.cluster.value for f in result.ext_procs if f.cluster is not None}
    for kind, document in documents:
        service_host = istio_traffic.host(document) if kind == "DestinationRule" else None
        for name in names:
            if service_host is not None and istio_traffic.names_host(name, service_host):
                result.clusters[name] = istio_traffic.cluster(document, name)
