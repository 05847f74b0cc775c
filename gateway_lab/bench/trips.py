"""Bootstrap edits for the arms that compare the admission filter's two ways of taking the
body: two round trips (the render's default: `BUFFERED`, after the headers reply) and one
(`STREAMED`, sent without waiting for the headers reply: `envoy render --one-round-trip`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from extproc.envoy_routes import ADMISSION_FILTER
from gateway_lab.bench import phases

WITHOUT_WAITING = "sendBodyWithoutWaitingForHeaderResponse"


def managers(bootstrap: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every HTTP connection manager of a bootstrap (JSON, camelCase as rendered)."""
    for listener in bootstrap["staticResources"]["listeners"]:
        for chain in listener["filterChains"]:
            for network_filter in chain["filters"]:
                if "httpFilters" in network_filter["typedConfig"]:
                    yield network_filter["typedConfig"]


def admission_configs(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    """The admission filters' typed configs (to edit in place)."""
    found = [
        http_filter["typedConfig"]
        for manager in managers(bootstrap)
        for http_filter in manager["httpFilters"]
        if http_filter["name"] == ADMISSION_FILTER
    ]
    if not found:
        raise ValueError("the bootstrap has no admission filter")
    return found


def set_one_round_trip(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """`bootstrap` (changed in place) with its admission filter streaming the body without
    waiting for the headers reply."""
    for config in admission_configs(bootstrap):
        config["processingMode"]["requestBodyMode"] = "STREAMED"
        config[WITHOUT_WAITING] = True
    return bootstrap


def one_round_trip(text: str) -> str:
    """The bootstrap with the access log's timing fields (gateway_lab.bench.phases) and one
    round trip."""
    return json.dumps(set_one_round_trip(json.loads(phases.timed_bootstrap(text))))
