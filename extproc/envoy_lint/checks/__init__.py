"""The checks, by the name each finding carries (`--format json` prints it)."""

from __future__ import annotations

from collections.abc import Callable

from extproc.envoy_lint.checks import (
    cluster,
    counting,
    filters,
    listener,
    paths,
    routes,
    timeouts,
)
from extproc.envoy_lint.findings import Issue
from extproc.envoy_lint.model import View
from extproc.envoy_lint.reference import Reference

Check = Callable[[View, Reference], list[Issue]]

CHECKS: dict[str, Check] = {
    "filter-order": filters.check_order_and_modes,
    "message-timeout": timeouts.check_message_timeouts,
    "stream-idle-timeout": timeouts.check_stream_idle_timeout,
    "route-timeout": timeouts.check_route_timeouts,
    "extproc-cluster": cluster.check_extproc_cluster,
    "pool-routes": routes.check_pool_routes,
    "skipped-filter": routes.check_skipped_filters,
    "failure-mode": filters.check_failure_mode,
    "body-limit": listener.check_body_limit,
    "path-normalisation": paths.check_path_normalisation,
    "counting-log": counting.check_counting_log,
}
ROUTE_CACHE = "route-cache"
"""The check that reads the whole file rather than a view (routes.check_route_cache)."""
