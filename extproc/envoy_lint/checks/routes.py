"""Check 6: the second route match on x-llm-pool, after the admission filter picks the pool.

Envoy picks a route before the filters run; the service sets x-llm-pool and clears the route
cache, so Envoy matches again. That needs a route per pool on the header, a default route
after them, and nothing that keeps the first match.
"""

from __future__ import annotations

from extproc.envoy_lint.findings import Issue, error, note
from extproc.envoy_lint.model import View
from extproc.envoy_lint.reference import Reference
from extproc.envoy_lint.source import Node
from extproc.envoy_lint.values import flag
from extproc.types import POOL_HEADER

_ROUTES_FIX = (
    f"one route per pool matching the {POOL_HEADER} header exactly, then a default route, "
    "each with timeout: 0s"
)


def check_pool_routes(view: View, ref: Reference) -> list[Issue]:
    if view.routes is None:
        return [
            note(
                view.line, "this file does not show the routes", f"make sure there is {_ROUTES_FIX}"
            )
        ]
    issues: list[Issue] = []
    # A route that matches every request shadows any pool route after it.
    catch_all = next((r for r in view.routes if r.catch_all), None)
    for pool in ref.pools:
        route = next((r for r in view.routes if r.pool == pool), None)
        if route is None:
            issues.append(
                error(
                    view.routes[0].line if view.routes else view.line,
                    f"no route for pool {pool} ({POOL_HEADER}: {pool}): the requests admission "
                    "sends there never reach it",
                    f"add a route matching header {POOL_HEADER} exactly {pool}",
                )
            )
        elif catch_all is not None and catch_all.line < route.line:
            issues.append(
                error(
                    route.line,
                    f"the route for pool {pool} comes after the default route (line "
                    f"{catch_all.line}), which matches first",
                    "put the default route last",
                )
            )
    # Requests admission does not route (GET /v1/models) carry no pool header; an allowlist
    # of paths may serve them instead of a catch-all.
    if not any(r.pool is None and r.forwards for r in view.routes):
        issues.append(
            error(
                view.routes[-1].line if view.routes else view.line,
                f"no route for requests without {POOL_HEADER} (GET /v1/models): they get 404",
                "add a last route with no header match (prefix /), to the smallest pool",
            )
        )
    return issues


def check_skipped_filters(view: View, _: Reference) -> list[Issue]:
    """An ext_proc filter turned off for requests that reach a cluster: those skip it.

    A filter disabled by default is fine when every route that forwards turns it on again,
    and a route that answers itself (direct response) may leave it off."""
    names = {f.name for f in view.ext_procs}
    forwarding = [r for r in view.routes or [] if r.forwards]
    issues = [
        error(
            f.disabled.line,
            f"{f.name} is disabled: it runs only on routes that turn it on again",
            "remove disabled: true",
        )
        for f in view.filters or []
        if f.ext_proc is not None
        and f.disabled is not None
        and f.disabled.value
        and (view.routes is None or any(f.name not in r.enabled_filters for r in forwarding))
    ]
    for route in forwarding:
        issues += [
            error(
                off.line,
                f"this route turns {off.value} off: its requests skip it",
                f"remove the typed_per_filter_config entry for {off.value}",
            )
            for off in route.disabled_filters
            if off.value in names
        ]
    return issues


def check_route_cache(documents: list[Node]) -> list[Issue]:
    """Anywhere in the file: settings that keep the first route match."""
    issues = []
    for document in documents:
        for key, node in document.walk():
            if key == "route_cache_action" and str(node.value).upper() == "RETAIN":
                issues.append(
                    error(
                        node.line,
                        "route_cache_action: RETAIN keeps the route picked before admission "
                        f"set {POOL_HEADER}",
                        "remove it (DEFAULT clears the route cache when the service asks)",
                    )
                )
            if key == "disable_clear_route_cache" and flag(node):
                issues.append(
                    error(
                        node.line,
                        "disable_clear_route_cache: true keeps the route picked before "
                        f"admission set {POOL_HEADER}",
                        "remove it",
                    )
                )
    return issues
