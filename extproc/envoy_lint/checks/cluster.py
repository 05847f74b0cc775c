"""Check 5: the cluster the ext_proc filters reach the service through."""

from __future__ import annotations

from extproc.envoy_lint.findings import Issue, error, note
from extproc.envoy_lint.model import Cluster, View
from extproc.envoy_lint.reference import (
    CIRCUIT_BREAKERS,
    ENVOY_CIRCUIT_BREAKER,
    MIN_KEEPALIVE_INTERVAL,
    RAISED_CIRCUIT_BREAKER,
    Reference,
)
from extproc.envoy_lint.values import format_seconds as s

_RAISE = f"raise it to {RAISED_CIRCUIT_BREAKER:,}"
_ENVOY_BREAKERS = (
    "circuit_breakers.thresholds max_connections, max_pending_requests and max_requests"
)


def _breakers(cluster: Cluster, spelled: str) -> list[Issue]:
    if cluster.thresholds is None:
        return [
            error(
                cluster.line,
                f"cluster {cluster.name} has no circuit breakers: Envoy's defaults "
                f"({ENVOY_CIRCUIT_BREAKER:,} requests, pending requests and connections) turn "
                "a burst of held requests into 503s",
                f"set {spelled} to {RAISED_CIRCUIT_BREAKER:,}",
            )
        ]
    issues = []
    for name in CIRCUIT_BREAKERS:
        setting = cluster.thresholds.get(name)
        value = setting.value if setting else ENVOY_CIRCUIT_BREAKER
        if value <= ENVOY_CIRCUIT_BREAKER:
            issues.append(
                error(
                    setting.line if setting else cluster.line,
                    f"cluster {cluster.name}: {name} is {value:,}"
                    + ("" if setting else " (Envoy's default)")
                    + ": every request in flight holds a gRPC stream, a held one two",
                    _RAISE,
                )
            )
    return issues


def _protocol(cluster: Cluster) -> list[Issue]:
    if not cluster.http2_shown:
        return [
            note(
                cluster.line,
                f"this file does not show whether cluster {cluster.name} speaks HTTP/2",
                "name the Service's port grpc (or set appProtocol: grpc)",
            )
        ]
    if cluster.http2 is None:
        return [
            error(
                cluster.line,
                f"cluster {cluster.name} speaks HTTP/1.1: gRPC needs HTTP/2",
                "set typed_extension_protocol_options envoy.extensions.upstreams.http.v3."
                "HttpProtocolOptions explicit_http_config.http2_protocol_options",
            )
        ]
    interval = cluster.keepalive_interval
    if interval is not None and 0 < interval.value < MIN_KEEPALIVE_INTERVAL:
        return [
            error(
                interval.line,
                f"cluster {cluster.name}: HTTP/2 keepalive every {s(interval.value)}: "
                "grpc-core closes connections that ping more often than every 30 s",
                f"set connection_keepalive.interval >= {s(MIN_KEEPALIVE_INTERVAL)}",
            )
        ]
    return []


def check_extproc_cluster(view: View, _: Reference) -> list[Issue]:
    """The cluster each ext_proc filter names, and the one Envoy Gateway makes for its backend."""
    clusters: list[Cluster] = [view.implied_cluster] if view.implied_cluster else []
    issues = []
    named = {f.cluster.value: f.cluster.line for f in view.ext_procs if f.cluster is not None}
    for name, line in named.items():
        found = view.clusters.get(name)
        if found is not None:
            clusters.append(found)
        elif view.clusters_shown:
            issues.append(
                error(line, f"cluster {name} is not defined", "add it to static_resources")
            )
        else:
            issues.append(
                note(
                    line,
                    f"cluster {name} is not in this file",
                    f"make sure it raises circuit breakers to {RAISED_CIRCUIT_BREAKER:,} and "
                    "speaks HTTP/2 (Istio: a DestinationRule; port named grpc)",
                )
            )
    for cluster in clusters:
        issues += _breakers(
            cluster, view.spelling.get("circuit_breakers", _ENVOY_BREAKERS)
        ) + _protocol(cluster)
    return issues
