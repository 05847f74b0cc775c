"""Istio's VirtualService (the pool routes) and DestinationRule (the ext_proc cluster's limits).

Istio's own defaults differ from Envoy's: a VirtualService route has no timeout unless it sets
one, and a cluster's circuit breakers are at their maximum unless a DestinationRule lowers
them. Whether the cluster speaks HTTP/2 comes from the Service's port (named `grpc`), which
these files cannot show.
"""

from __future__ import annotations

from extproc.envoy_lint.kinds import envoy_api
from extproc.envoy_lint.model import Cluster, Route, Setting
from extproc.envoy_lint.source import Node
from extproc.envoy_lint.values import integer
from extproc.types import POOL_HEADER

ISTIO_CIRCUIT_BREAKER = 2**32 - 1
"""What Istio sets for a limit a DestinationRule leaves out."""
_CONNECTION_POOL = {
    ("tcp", "max_connections"): "max_connections",
    ("http", "http1_max_pending_requests"): "max_pending_requests",
    ("http", "http2_max_requests"): "max_requests",
}


def _route(rule: Node, match: Node | None) -> Route:
    header = match.at("headers", POOL_HEADER, "exact") if match is not None else None
    others = match.entries() if match is not None else []
    prefix = match.at("uri", "prefix") if match is not None else None
    catch_all = all(key == "uri" for key, _ in others) and (
        match is None or match.get("uri") is None or (prefix is not None and prefix.value == "/")
    )
    timeout = envoy_api.seconds_setting(rule.get("timeout"))
    return Route(
        line=match.line if match is not None else rule.line,
        pool=str(header.value) if header is not None else None,
        catch_all=catch_all and header is None,
        # Istio's default: no route timeout.
        timeout=timeout if timeout is not None else Setting(0.0, rule.line),
        forwards=rule.get("route") is not None,
    )


def routes(virtual_service: Node) -> list[Route]:
    rules = virtual_service.at("spec", "http")
    found = []
    for rule in rules.items() if rules is not None else []:
        matches = rule.get("match")
        items = matches.items() if matches is not None else []
        found += [_route(rule, m) for m in items] if items else [_route(rule, None)]
    return found


def host(destination_rule: Node) -> str | None:
    node = destination_rule.at("spec", "host")
    return node.text() if node is not None else None


def cluster(destination_rule: Node, name: str) -> Cluster:
    """The cluster `name` (Istio's outbound|PORT||HOST) as the DestinationRule shapes it."""
    pool = destination_rule.at("spec", "traffic_policy", "connection_pool")
    thresholds: dict[str, Setting[int]] = {}
    for (section, key), envoy_name in _CONNECTION_POOL.items():
        node = pool.at(section, key) if pool is not None else None
        value = integer(node) if node is not None else None
        thresholds[envoy_name] = (
            Setting(value, node.line)
            if node is not None and value is not None
            else Setting(ISTIO_CIRCUIT_BREAKER, destination_rule.line)
        )
    return Cluster(name, destination_rule.line, thresholds, http2=None, http2_shown=False)


def names_host(cluster_name: str, service_host: str) -> bool:
    """Whether Istio's cluster name (outbound|PORT|SUBSET|HOST) is for this host."""
    cluster_host = cluster_name.rsplit("|", 1)[-1]
    return cluster_host == service_host or cluster_host.startswith(service_host + ".")
