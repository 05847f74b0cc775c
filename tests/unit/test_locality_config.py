"""The dlpm policy keys (strict), the per-replica clusters and routes Envoy gets, the engines'
prefix-cache counters and how they reach the locality index."""

from __future__ import annotations

import orjson
import pytest

from extproc.envoy_config import RenderOptions, render_bootstrap
from extproc.envoy_lint.lint import lint_file
from extproc.envoy_lint.reference import reference
from extproc.policy import PolicyError, policy_from_text
from extproc.scheduler.locality import LocalityIndex
from extproc.service.engine_metrics import EngineReading, parse_engine_metrics
from extproc.service.engine_poller import EnginePoller
from extproc.service.locality_feedback import LocalityFeedback
from extproc.types import POOL_HEADER, REPLICA_HEADER
from tests.conftest import policy_yaml

_TWO = '127.0.0.1:8001", "127.0.0.1:8003'


def _issues(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        policy_from_text(text, "p.yaml")
    return [str(issue) for issue in caught.value.issues]


def test_locality_keys_are_strict_with_file_and_line() -> None:
    bad_key = policy_yaml(extra="fairness: {policy: dlpm, locality: {block_size: 64}}\n")
    [issue] = _issues(bad_key)
    assert "fairness.locality.block_size: unknown key" in issue and issue.startswith("p.yaml:")
    too_small = policy_yaml(extra="fairness: {policy: dlpm, locality: {block_bytes: 8}}\n")
    assert "fairness.locality.block_bytes" in _issues(too_small)[0]
    zero_slack = policy_yaml(extra="fairness: {policy: dlpm, locality: {load_slack: 0}}\n")
    assert "fairness.locality.load_slack" in _issues(zero_slack)[0]
    assert "fairness.policy" in _issues(policy_yaml(extra="fairness: {policy: lpm}\n"))[0]
    bad_kv = policy_yaml().replace(
        "max_inflight: 8\n", "max_inflight: 8\n    replica_kv_tokens: 0\n"
    )
    assert "pools.long.replica_kv_tokens" in _issues(bad_kv)[0]
    policy = policy_from_text(
        policy_yaml(extra="fairness: {policy: dlpm, locality: {block_bytes: 512, load_slack: 2}}\n")
    )
    assert policy.source.fairness.locality.block_bytes == 512
    assert policy.pools["short"].kv_tokens_per_replica == 400_000


def _bootstrap(text: str) -> dict[str, object]:
    rendered = render_bootstrap(policy_from_text(text), RenderOptions())
    return orjson.loads(rendered)  # type: ignore[no-any-return]


def test_a_pool_with_two_endpoints_gets_a_cluster_and_a_route_per_replica() -> None:
    bootstrap = _bootstrap(policy_yaml(short_endpoint=_TWO))
    clusters = {c["name"]: c for c in bootstrap["staticResources"]["clusters"]}  # type: ignore[index]
    assert {"pool_short", "pool_short_replica_0", "pool_short_replica_1", "pool_long"} <= set(
        clusters
    )
    assert "pool_long_replica_0" not in clusters  # one endpoint: nothing to choose
    one = clusters["pool_short_replica_1"]["loadAssignment"]["endpoints"][0]["lbEndpoints"]
    assert [e["endpoint"]["address"]["socketAddress"]["portValue"] for e in one] == [8003]
    manager = bootstrap["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0][  # type: ignore[index]
        "typedConfig"
    ]
    routes = manager["routeConfig"]["virtualHosts"][0]["routes"]
    chat = [r for r in routes if r["match"].get("path") == "/v1/chat/completions" and "route" in r]
    targets = []
    for route in chat:
        headers = {h["name"]: h["stringMatch"]["exact"] for h in route["match"]["headers"]}
        targets.append(
            (headers.get(POOL_HEADER), headers.get(REPLICA_HEADER), route["route"]["cluster"])
        )
    # the replica routes come before the pool's own route, which balances both endpoints
    assert targets[:3] == [
        ("short", "0", "pool_short_replica_0"),
        ("short", "1", "pool_short_replica_1"),
        ("short", None, "pool_short"),
    ]


def test_the_render_with_replica_routes_passes_envoy_lint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = policy_yaml(short_endpoint=_TWO, extra="fairness: {policy: dlpm}\n")
    policy = policy_from_text(text)
    config = tmp_path / "envoy.json"
    config.write_text(render_bootstrap(policy, RenderOptions()))
    findings = lint_file(str(config), reference(policy))
    assert [f for f in findings if f.severity == "error"] == []


def test_engine_page_gives_the_prefix_cache_counters() -> None:
    page = (
        'vllm:num_requests_running{engine="0"} 1\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1200.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0\n'
    )
    reading = parse_engine_metrics(page)
    assert reading is not None
    assert (reading.prefix_queries, reading.prefix_hits) == (1200.0, 900.0)
    without = parse_engine_metrics("vllm:num_requests_running 1\n")
    assert without is not None and without.prefix_queries is None


async def test_feedback_hands_each_replica_the_increments_of_its_engine() -> None:
    policy = policy_from_text(policy_yaml(short_endpoint=_TWO, extra="fairness: {policy: dlpm}\n"))
    index = LocalityIndex(policy)
    clock = [0.0]
    feedback = LocalityFeedback(
        index, EnginePoller(), interval_s=2.0, now=lambda: clock[0], bytes_per_token=lambda: 3.52
    )
    assert feedback.due_in() == 0.0
    assert set(feedback.wanted()) == {"127.0.0.1:8001", "127.0.0.1:8003", "127.0.0.1:8002"}
    assert index.bytes_per_token == 3.5  # the estimator's, rounded to 0.05
    assert feedback.due_in() == 2.0

    def reading(queries: float, hits: float) -> EngineReading:
        return EngineReading(0, 0, 0, prefix_queries=queries, prefix_hits=hits)

    feedback.deliver({"127.0.0.1:8001": reading(100, 10), "127.0.0.1:8003": None})
    feedback.deliver({"127.0.0.1:8001": reading(400, 160), "127.0.0.1:8003": reading(50, 5)})
    rows = index.pools["short"].describe()
    assert (rows[0]["engine_query_tokens"], rows[0]["engine_hit_tokens"]) == (300.0, 150.0)
    assert rows[1]["engine_hit_tokens"] == 0.0  # its first reading is only the base
    feedback.deliver({"127.0.0.1:8001": reading(20, 0)})  # the engine restarted: a new base
    assert index.pools["short"].describe()[0]["engine_query_tokens"] == 300.0


def test_policy_check_explains_the_locality_index_and_warns_about_shared_state() -> None:
    from extproc.policy.capacity import capacity_warnings, describe_pools

    dlpm = "fairness: {policy: dlpm}\n"
    source = policy_from_text(policy_yaml(short_endpoint=_TWO, extra=dlpm)).source
    short, long_ = describe_pools(source)
    assert short.endswith(
        "locality index 2 x 200000 KV tokens (max_inflight_tokens / endpoints; "
        "the gateway picks the replica)"
    )
    assert long_.endswith(
        "locality index 1 x 600000 KV tokens (max_inflight_tokens / endpoints; one replica)"
    )
    assert all(w.field != "fairness.policy" for w in capacity_warnings(source))
    shared = policy_from_text(
        policy_yaml(short_endpoint=_TWO, extra=dlpm + "state: {backend: redis}\n")
    ).source
    fields = [(w.pool, w.field) for w in capacity_warnings(shared)]
    assert ("short", "fairness.policy") in fields and ("long", "fairness.policy") not in fields
    plain = policy_from_text(policy_yaml(short_endpoint=_TWO)).source
    assert all("locality" not in line for line in describe_pools(plain))
