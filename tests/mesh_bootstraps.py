"""The Envoy pieces of deploy/istio and deploy/envoy-gateway applied to a bootstrap rendered with
counting in Envoy, as each mesh applies them to its gateway's Envoy, so the real Envoy can
validate them (tests/dataplane/test_prod_deploy.py) and run them in front of the real service
(tests/dataplane/test_mesh_counting.py).

The mesh's names for the service (`outbound|50051||extproc.llm-gateway.svc.cluster.local`,
`extproc.llm-gateway.svc.cluster.local:50053`) are kept where a filter refers to them by
cluster, with clusters of those names added; only what Envoy would resolve through DNS (the
addresses of the clusters the Envoy Gateway patch adds) is pointed at the addresses the
service really listens on.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from extproc.envoy_config import EXTPROC_CLUSTER
from extproc.envoy_lua import COUNTING_FILTER, EVENTS_CLUSTER, counting_script
from tests.deploy_files import DEPLOY, find, port_of, rendered_manager

SERVICE_HOST = "extproc.llm-gateway.svc.cluster.local"
GRPC_ACCESS_LOG = "envoy.access_loggers.http_grpc"
COUNTS_CLUSTER = "extproc_counts"
"""The cluster the Envoy Gateway patch adds for the access log."""


def camel(key: str) -> str:
    """Proto JSON's camelCase name of a snake_case field: a bootstrap must not name a field
    both ways."""
    return re.sub(r"_([a-z0-9])", lambda match: match.group(1).upper(), key)


def _clusters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    clusters: list[dict[str, Any]] = bootstrap["staticResources"]["clusters"]
    return clusters


def _take_cluster(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    clusters = _clusters(bootstrap)
    found = next(c for c in clusters if c["name"] == name)
    clusters.remove(found)
    return found


def _renamed(cluster: dict[str, Any], name: str) -> dict[str, Any]:
    copied = copy.deepcopy(cluster)
    copied["name"] = copied["loadAssignment"]["clusterName"] = name
    return copied


def _own_logs(manager: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendered access logs without the rendered counting log (the mesh file brings its own)."""
    return [log for log in manager.get("accessLog", []) if log["name"] != GRPC_ACCESS_LOG]


def istio_patches() -> list[dict[str, Any]]:
    patches: list[dict[str, Any]] = find("istio", "EnvoyFilter")["spec"]["configPatches"]
    return patches


def istio_cluster(port: int) -> str:
    return f"outbound|{port}||{SERVICE_HOST}"


def istio_bootstrap(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The EnvoyFilter's patches on `bootstrap`: its HTTP filters just before the router, its
    MERGE into the connection manager (the access log appended to the gateway's own) and the
    listener, and the clusters Istio makes for the Service's ports."""
    result = copy.deepcopy(bootstrap)
    manager = rendered_manager(result)
    patches = istio_patches()
    router = manager["httpFilters"][-1]
    inserted = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER"]
    manager["httpFilters"] = [*copy.deepcopy(inserted), router]
    merged = next(p for p in patches if p["applyTo"] == "NETWORK_FILTER")["patch"]["value"]
    for key, value in merged["typed_config"].items():
        if key == "access_log":
            manager["accessLog"] = [*_own_logs(manager), *copy.deepcopy(value)]
        elif key != "@type":
            manager[camel(key)] = value
    listener_merge = next(p for p in patches if p["applyTo"] == "LISTENER")["patch"]["value"]
    listener = result["staticResources"]["listeners"][0]
    for key, value in listener_merge.items():
        listener[camel(key)] = value
    grpc = _take_cluster(result, EXTPROC_CLUSTER)
    events = _take_cluster(result, EVENTS_CLUSTER)
    _clusters(result).extend(
        [_renamed(grpc, istio_cluster(50051)), _renamed(events, istio_cluster(50053))]
    )
    return result


def envoy_gateway_operations() -> list[dict[str, Any]]:
    operations = find("envoy-gateway", "EnvoyPatchPolicy")["spec"]["jsonPatches"]
    return [entry["operation"] for entry in operations]


def envoy_gateway_bootstrap(
    bootstrap: dict[str, Any], grpc: str | None = None, events: str | None = None
) -> dict[str, Any]:
    """The EnvoyPatchPolicy's counting pieces on `bootstrap`: its Lua filter in place of the
    rendered one, its access log and the clusters it adds. `grpc` and `events` (the service's
    addresses) replace the Service's DNS name in those clusters."""
    result = copy.deepcopy(bootstrap)
    manager = rendered_manager(result)
    operations = envoy_gateway_operations()
    added = [op for op in operations if op["op"] == "add"]
    counting = next(op["value"] for op in added if op["path"].endswith("/http_filters/-")
                    and op["value"]["name"] == COUNTING_FILTER)  # fmt: skip
    manager["httpFilters"] = [
        copy.deepcopy(counting) if f["name"] == COUNTING_FILTER else f
        for f in manager["httpFilters"]
    ]
    log = copy.deepcopy(next(op["value"] for op in added if op["path"].endswith("/access_log/-")))
    manager["accessLog"] = [*_own_logs(manager), log]
    _take_cluster(result, EVENTS_CLUSTER)
    for cluster in (copy.deepcopy(op["value"]) for op in added if op["path"] == ""):
        target = {EVENTS_CLUSTER: events, COUNTS_CLUSTER: grpc}[cluster["name"]]
        if target is not None:
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
            address = endpoint["endpoint"]["address"]["socket_address"]
            address["address"], address["port_value"] = target.rpartition(":")[0], port_of(target)
        _clusters(result).append(cluster)
    return result


_SCRIPT_INDENT = " " * 16


def embed_counting_scripts() -> list[Path]:
    """Rewrite the counting script inlined in the Istio and Envoy Gateway files with the one
    extproc/envoy_lua.py makes now (each with its cluster); returns the files changed.
    Run `python -m tests.mesh_bootstraps` after changing the script."""
    changed = []
    for path, cluster in (
        (DEPLOY / "istio" / "envoyfilter.yaml", istio_cluster(50053)),
        (DEPLOY / "envoy-gateway" / "envoypatchpolicy.yaml", EVENTS_CLUSTER),
    ):
        text = path.read_text()
        lines = text.split("\n")
        start = lines.index("              inline_string: |") + 1
        end = start
        while end < len(lines) and (not lines[end] or lines[end].startswith(_SCRIPT_INDENT)):
            end += 1
        while end > start and not lines[end - 1]:  # the blank lines after the script stay
            end -= 1
        script = counting_script(cluster).rstrip("\n").split("\n")
        indented = [_SCRIPT_INDENT + line if line else "" for line in script]
        new = "\n".join(lines[:start] + indented + lines[end:])
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


__all__ = [
    "COUNTS_CLUSTER",
    "SERVICE_HOST",
    "camel",
    "embed_counting_scripts",
    "envoy_gateway_bootstrap",
    "envoy_gateway_operations",
    "istio_bootstrap",
    "istio_cluster",
    "istio_patches",
]


if __name__ == "__main__":
    for changed in embed_counting_scripts():
        print(f"rewrote the counting script in {changed}")
