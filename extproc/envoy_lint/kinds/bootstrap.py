"""A whole Envoy bootstrap (YAML or JSON): one view per HTTP connection manager."""

from __future__ import annotations

from extproc.envoy_lint.kinds import envoy_api
from extproc.envoy_lint.model import Cluster, Setting, View
from extproc.envoy_lint.source import Node
from extproc.envoy_lint.values import integer


def is_bootstrap(document: Node) -> bool:
    return document.get("static_resources") is not None or (
        document.get("dynamic_resources") is not None
    )


def _managers(listener: Node) -> list[Node]:
    chains = listener.get("filter_chains")
    found = []
    for chain in [
        *(chains.items() if chains is not None else []),
        listener.get("default_filter_chain"),
    ]:
        filters = chain.get("filters") if chain is not None else None
        for entry in filters.items() if filters is not None else []:
            config = entry.get("typed_config")
            name = entry.get("name")
            if config is not None and (
                envoy_api.type_url(config).endswith(envoy_api.HCM_TYPE)
                or (name is not None and name.value == envoy_api.HCM_NAME)
            ):
                found.append(config)
    return found


def _view(listener: Node, config: Node, clusters: dict[str, Cluster], cds: bool) -> View:
    entries = config.get("http_filters")
    filters = [envoy_api.http_filter(e) for e in (entries.items() if entries is not None else [])]
    limit = listener.get("per_connection_buffer_limit_bytes")
    limit_value = integer(limit) if limit is not None else None
    route_config = config.get("route_config")
    return View(
        line=config.line,
        complete=True,
        filters=filters,
        ext_procs=[f.ext_proc for f in filters if f.ext_proc is not None],
        manager=envoy_api.manager(config),
        buffer_limit=(
            Setting(limit_value, limit.line)
            if limit is not None and limit_value is not None
            else None
        ),
        buffer_limit_shown=True,
        listener_line=listener.line,
        routes=envoy_api.routes(route_config) if route_config is not None else None,
        grpc_logs=envoy_api.grpc_logs(config.get("access_log")),
        clusters=clusters,
        # With CDS, a cluster missing here may come from the management server.
        clusters_shown=not cds,
    )


def views(document: Node) -> list[View]:
    resources = document.get("static_resources")
    listeners = resources.get("listeners") if resources is not None else None
    cluster_nodes = resources.get("clusters") if resources is not None else None
    clusters = {
        c.name: c
        for c in (envoy_api.cluster(e) for e in (cluster_nodes.items() if cluster_nodes else []))
    }
    cds = document.at("dynamic_resources", "cds_config") is not None
    found = [
        _view(listener, config, clusters, cds)
        for listener in (listeners.items() if listeners is not None else [])
        for config in _managers(listener)
    ]
    with_ext_proc = [v for v in found if v.ext_procs]
    if with_ext_proc:
        return with_ext_proc
    if found:
        return found
    # No static listener (LDS): every piece of the pipeline is then "not shown".
    return [View(line=document.line, complete=False, clusters=clusters)]
