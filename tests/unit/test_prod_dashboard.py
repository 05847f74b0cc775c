"""The Grafana dashboard is valid dashboard JSON whose PromQL names only metrics that exist: the
extproc ones as registered in extproc.metrics.Metrics, vLLM's as the engines publish them, and
Envoy's as Envoy 1.40 publishes them (checked against a live Envoy in the data-plane test)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.metrics import Metrics
from gateway_lab.engine.server import running_engine
from tests.deploy_files import DASHBOARDS, PROVISIONING, load_yaml

DASHBOARD = DASHBOARDS / "llm-gateway.json"

# Envoy's Prometheus names the dashboard uses, as `/stats/prometheus` of Envoy 1.40 shows them
# for the rendered bootstrap (test_prod_dataplane checks this list against a running Envoy).
ENVOY_METRICS = frozenset(
    {
        "envoy_http_downstream_rq_xx",
        "envoy_http_downstream_rq_time_bucket",
        "envoy_http_ext_proc_admission_streams_failed",
        "envoy_http_ext_proc_admission_message_timeouts",
        "envoy_http_ext_proc_admission_override_message_timeout_ignored",
        "envoy_cluster_upstream_rq_pending_overflow",
    }
)

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}
_NAME = re.compile(r"(?<![\w:])(extproc_\w+|envoy_\w+|vllm:[\w:]+)")
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS = re.compile(r"\{[^}]*\}")


def extproc_series() -> set[str]:
    """Every series name the service can expose, from the families registered in Metrics()."""
    names = set()
    for family in Metrics().registry.collect():
        for suffix in _SUFFIXES[family.type]:
            names.add(family.name + suffix)
    return names


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in data["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(data: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in panels(data) for t in p.get("targets", [])]
    for variable in data.get("templating", {}).get("list", []):
        query = variable.get("query")
        out.append(query["query"] if isinstance(query, dict) else str(query))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label names in matchers and clauses excluded)."""
    stripped = _MATCHERS.sub("", _CLAUSE.sub("", expr))
    return set(_NAME.findall(stripped))


def test_dashboard_is_valid_grafana_json() -> None:
    data = dashboard()
    assert data["uid"] and data["title"] and isinstance(data["schemaVersion"], int)
    ids = [p["id"] for p in panels(data)]
    assert len(ids) == len(set(ids))
    datasource_uids = {d["uid"] for d in load_yaml(
        PROVISIONING / "datasources" / "prometheus.yml")["datasources"]}  # fmt: skip
    for panel in panels(data):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["type"] in {"row", "timeseries", "stat", "gauge", "table", "bargauge"}
        if panel["type"] == "row":
            continue
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"]["uid"] in datasource_uids
        for target in panel["targets"]:
            assert target["datasource"]["uid"] in datasource_uids
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["expr"].count("{") == target["expr"].count("}"), target["expr"]


def test_dashboard_covers_what_operators_need() -> None:
    used = set().union(*(metric_names(q) for q in queries(dashboard())))
    for needed in (
        "extproc_ttft_seconds_bucket",  # per-tenant time to first token
        "extproc_queue_wait_seconds_bucket",  # queue wait
        "extproc_tokens_total",  # tokens/s
        "extproc_requests_total",  # rejections by reason (outcome label)
        "extproc_pool_inflight_requests",  # pool utilisation
        "extproc_pool_max_inflight_requests",
        "extproc_shed_total",  # the service falling behind: what it shed, why
        "extproc_event_loop_lag_seconds",
        "extproc_overload_shedding",
        "extproc_event_loop_cpu_wait_ratio",
    ):
        assert needed in used, needed
    rejections = [q for q in queries(dashboard()) if "outcome" in q and "extproc_requests" in q]
    assert any('outcome!="admitted"' in q for q in rejections)


def test_extproc_queries_name_only_registered_metrics() -> None:
    known = extproc_series()
    for expr in queries(dashboard()):
        names = metric_names(expr)
        assert names, f"no known metric in {expr!r}"
        unknown = {n for n in names if n.startswith("extproc_")} - known
        assert not unknown, f"{expr!r} names unregistered metrics {unknown}"


def test_envoy_queries_name_known_envoy_metrics() -> None:
    for expr in queries(dashboard()):
        unknown = {n for n in metric_names(expr) if n.startswith("envoy_")} - ENVOY_METRICS
        assert not unknown, f"{expr!r}: {unknown}"


async def test_vllm_queries_name_metrics_the_engines_publish() -> None:
    async with (
        running_engine(profile="fast") as engine,
        aiohttp.ClientSession() as session,
        session.get(f"{engine.base_url}/metrics") as response,
    ):
        text = await response.text()
    published = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    used = {n for q in queries(dashboard()) for n in metric_names(q) if n.startswith("vllm:")}
    assert used and used <= published, used - published
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in used


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (envoy_cluster_name) (rate(envoy_cluster_upstream_rq_total{x="y"}[1m]))',
         {"envoy_cluster_upstream_rq_total"}),
        ("histogram_quantile(0.9, sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket[5m])))",
         {"vllm:e2e_request_latency_seconds_bucket"}),
        ('extproc_a / on(pool) extproc_b{tenant=~"$tenant"}', {"extproc_a", "extproc_b"}),
    ],
)  # fmt: skip
def test_metric_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_dashboard_file_is_what_the_provisioning_loads(tmp_path: Path) -> None:
    provider = load_yaml(PROVISIONING / "dashboards" / "llm-gateway.yml")["providers"][0]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert DASHBOARD.parent == DASHBOARDS
