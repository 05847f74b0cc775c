"""`python -m gateway_lab.bench.envoy_counting`: the bootstrap edit that puts the counting Lua
filter in Envoy, the access-log reader and the per-chunk arithmetic."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.envoy_config import RenderOptions, render_bootstrap
from extproc.policy import policy_from_text
from gateway_lab.bench.envoy_counting import (
    COUNTING_LUA,
    EVENTS_CLUSTER,
    NOTIFY_EVERY,
    TOKENS_FIELD,
    counted_tokens,
    notifying_lua,
    per_chunk,
    with_counting,
)
from tests.conftest import policy_yaml


def _manager(config: Any) -> Any:
    listener = config["staticResources"]["listeners"][0]
    return listener["filterChains"][0]["filters"][0]["typedConfig"]


def test_the_counting_filter_goes_just_before_the_router_and_its_count_into_the_log() -> None:
    policy = policy_from_text(policy_yaml("127.0.0.1:1", "127.0.0.1:2"))
    rendered = render_bootstrap(policy, RenderOptions(extproc_filters=False, access_log=True))
    manager = _manager(json.loads(with_counting(rendered)))
    names = [f["name"] for f in manager["httpFilters"]]
    assert names[-2:] == ["envoy.filters.http.lua", "envoy.filters.http.router"]
    lua = manager["httpFilters"][-2]["typedConfig"]
    assert lua["defaultSourceCode"]["inlineString"] == COUNTING_LUA
    log = manager["accessLog"][0]["typedConfig"]["logFormat"]["jsonFormat"]
    assert log[TOKENS_FIELD] == "%DYNAMIC_METADATA(gw:tokens)%"
    with pytest.raises(ValueError, match="no HTTP connection manager"):
        with_counting(json.dumps({"staticResources": {}}))


def test_the_notifying_script_posts_every_n_chunks_to_a_cluster_of_its_own() -> None:
    policy = policy_from_text(policy_yaml("127.0.0.1:1", "127.0.0.1:2"))
    rendered = render_bootstrap(policy, RenderOptions(extproc_filters=False, access_log=True))
    config = json.loads(with_counting(rendered, events="127.0.0.1:4321"))
    lua = _manager(config)["httpFilters"][-2]["typedConfig"]["defaultSourceCode"]["inlineString"]
    assert lua == notifying_lua(NOTIFY_EVERY) != COUNTING_LUA
    assert f"chunks % {NOTIFY_EVERY} == 0" in lua and f'httpCall("{EVENTS_CLUSTER}"' in lua
    assert lua.index("local usage = nil\n  local chunks = 0") < lua.index("bodyChunks")
    clusters = {c["name"]: c for c in config["staticResources"]["clusters"]}
    endpoint = clusters[EVENTS_CLUSTER]["loadAssignment"]["endpoints"][0]["lbEndpoints"][0]
    assert endpoint["endpoint"]["address"]["socketAddress"] == {
        "address": "127.0.0.1", "portValue": 4321,
    }  # fmt: skip


def test_counts_are_read_from_the_json_lines_only() -> None:
    lines = [
        json.dumps({"status": 200, TOKENS_FIELD: 500}),
        "[2026-12-05 20:00:00.000][1][warning] not an access-log line",
        json.dumps({"status": 200, TOKENS_FIELD: "20"}),
        json.dumps({"status": 429, TOKENS_FIELD: "-"}),  # Envoy answered: nothing counted
        json.dumps({"status": 200}),
    ]
    assert counted_tokens("\n".join(lines)) == [500, 20]


def _run(tokens: int, requests: int, events: float, envoy_s: float, front_s: float) -> Any:
    return {"tokens": tokens, "requests": requests, "events_per_request": events,
            "cpu_s": {"envoy": envoy_s, "front": front_s}}  # fmt: skip


def test_cpu_per_chunk_is_the_slope_between_the_sizes_over_merged_rounds() -> None:
    runs = [
        _run(20, 100, 23.0, 0.10, 0.20),  # 1,000 / 2,000 us a request
        _run(500, 10, 503.0, 0.06, 0.10),
        _run(20, 100, 23.0, 0.10, 0.20),
        _run(500, 10, 503.0, 0.04, 0.10),  # merged: 5,000 / 10,000 us a request
    ]
    found = per_chunk(runs)
    assert found["envoy"] == pytest.approx((5000 - 1000) / 480)
    assert found["front"] == pytest.approx((10000 - 2000) / 480)
    assert found["both"] == pytest.approx(found["envoy"] + found["front"])
