"""Bootstrap edits for the arms that compare the admission filter's two ways of taking the
body: two round trips (the render's default: `BUFFERED`, after the headers reply) and one
(`STREAMED`, sent without waiting for the headers reply: `envoy render --one-round-trip`).
Each also adds the access log's timing fields (gateway_lab.bench.phases)."""

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


def _admission_configs(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    found = [
        http_filter["typedConfig"]
        for manager in managers(bootstrap)
        for http_filter in manager["httpFilters"]
        if http_filter["name"] == ADMISSION_FILTER
    ]
    if not found:
        raise ValueError("the bootstrap has no admission filter")
    return found


def set_round_trips(bootstrap: dict[str, Any], trips: int) -> dict[str, Any]:
    """`bootstrap` (changed in place) with its admission filter taking the body in one round
    trip or two."""
    if trips not in (1, 2):
        raise ValueError("one round trip or two")
    for config in _admission_configs(bootstrap):
        config["processingMode"]["requestBodyMode"] = "STREAMED" if trips == 1 else "BUFFERED"
        if trips == 1:
            config[WITHOUT_WAITING] = True
        else:
            config.pop(WITHOUT_WAITING, None)
    return bootstrap


def one_round_trip(text: str) -> str:
    """The timed bootstrap, its admission filter streaming the body without waiting."""
    return json.dumps(set_round_trips(json.loads(phases.timed_bootstrap(text)), 1))


def two_round_trips(text: str) -> str:
    """The timed bootstrap, its admission filter buffering the body after the headers reply."""
    return json.dumps(set_round_trips(json.loads(phases.timed_bootstrap(text)), 2))
