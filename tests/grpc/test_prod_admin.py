"""Every admin endpoint: /healthz, /readyz, /metrics, /v1/tenants, POST /v1/reload."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
)
from prometheus_client.parser import text_string_to_metric_families

from extproc.admin import AdminServer, is_loopback
from extproc.metrics import UNKNOWN_TENANT, Metrics
from extproc.policy import load_policy
from extproc.reload import PolicyReloader
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.main import ServeOptions, Service
from extproc.service.server import start_grpc_server
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import (
    EnvoyPeer,
    body_message,
    chat_body,
    headers_message,
    set_headers,
)
from tests.serve_support import AccountingPeer

CHAT = "/v1/chat/completions"


@dataclass
class Admin:
    gateway: Gateway
    server: AdminServer
    url: str
    session: aiohttp.ClientSession
    stub: ext_proc_grpc.ExternalProcessorStub
    path: Path

    async def get(self, route: str) -> tuple[int, Any]:
        async with self.session.get(self.url + route) as response:
            text = await response.text()
            if response.content_type == "application/json":
                return response.status, orjson.loads(text)
            return response.status, text


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[Admin]:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml(short_inflight=1))
    gateway = compose(load_policy(path))
    reloader = PolicyReloader(str(path), gateway.apply_policy, gateway.metrics, interval_s=0)
    reloader.mark_loaded(path.read_text())
    server = AdminServer(gateway, reloader=reloader)
    port = await server.start("127.0.0.1:0")
    grpc_server, grpc_port = await start_grpc_server(gateway, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    session = aiohttp.ClientSession()
    try:
        yield Admin(
            gateway, server, f"http://127.0.0.1:{port}", session,
            ext_proc_grpc.ExternalProcessorStub(channel), path,
        )  # fmt: skip
    finally:
        await session.close()
        await channel.close()
        await grpc_server.stop(None)
        await server.stop()


def _headers(pairs: dict[str, str], eos: bool = False) -> HttpHeaders:
    return HttpHeaders(
        headers=HeaderMap(
            headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=eos,
    )


async def served_request(stub: ext_proc_grpc.ExternalProcessorStub, key: str) -> None:
    """Admission, then a whole JSON response through the accounting stream, then the admission
    stream's end (what Envoy does; the accounting stream is attached before the response)."""
    admission = EnvoyPeer(stub)
    await admission.send(headers_message("POST", CHAT, key, [("x-tenant-id", "evil-tenant")]))
    reply = await admission.send(body_message(chat_body("count these words please")))
    request_id = set_headers(reply, "request_body")["x-gateway-request-id"]
    accounting = AccountingPeer(stub)
    put = accounting.outbox.put
    await put(ProcessingRequest(observability_mode=True, request_headers=_headers(
        {":method": "POST", ":path": CHAT, "x-gateway-request-id": request_id})))  # fmt: skip
    response_headers = _headers({":status": "200", "content-type": "application/json"})
    await put(ProcessingRequest(observability_mode=True, response_headers=response_headers))
    usage = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    body = orjson.dumps({"choices": [{"message": {"content": "ok"}}], "usage": usage})
    await put(ProcessingRequest(observability_mode=True,
                                response_body=HttpBody(body=body, end_of_stream=True)))  # fmt: skip
    await accounting.close()
    await accounting.call.code()
    await admission.send(ProcessingRequest(response_headers=response_headers))
    await admission.close()
    await admission.call.code()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


async def test_healthz_and_readyz(admin: Admin) -> None:
    status, body = await admin.get("/healthz")
    assert status == 200 and body["status"] == "ok"
    status, body = await admin.get("/readyz")
    assert status == 200 and body["status"] == "ready"
    assert body["policy"]["file"] == str(admin.path)
    assert body["policy"]["fingerprint"].startswith("sha256:")
    admin.server.draining = True
    status, body = await admin.get("/readyz")
    assert status == 503 and body["status"] == "draining"
    status, _ = await admin.get("/healthz")
    assert status == 200  # liveness stays up while draining


async def test_readyz_is_503_before_a_policy_is_loaded() -> None:
    server = AdminServer()
    port = await server.start("127.0.0.1:0")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 503
                assert (await response.json())["status"] == "starting"
            async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                assert response.status == 200
            async with session.get(f"http://127.0.0.1:{port}/v1/tenants") as response:
                assert response.status == 503
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                assert response.status == 200
                assert "extproc_ready 0.0" in await response.text()
    finally:
        await server.stop()


async def test_metrics_cover_requests_queues_pools_tokens_and_labels_stay_bounded(
    admin: Admin,
) -> None:
    await served_request(admin.stub, TEST_KEYS["globex"])
    # One in flight, one queued behind it (the short pool takes one request).
    holder = EnvoyPeer(admin.stub)
    await holder.send(headers_message("POST", CHAT, TEST_KEYS["acme"]))
    await holder.send(body_message(chat_body()))
    queued = EnvoyPeer(admin.stub)
    await queued.send(headers_message("POST", CHAT, TEST_KEYS["initech"]))
    assert (await queued.send(body_message(chat_body()))).HasField("override_message_timeout")
    # A wrong key: counted under tenant "unknown", the key never becomes a label.
    stranger = EnvoyPeer(admin.stub)
    await stranger.send(headers_message("POST", CHAT, "sk-client-chosen-value"))
    await stranger.close()
    await stranger.call.code()

    status, text = await admin.get("/metrics")
    assert status == 200
    found = samples(text)
    requests = "extproc_requests_total"
    assert value(found, requests, tenant="globex", tier="standard", pool="short",
                 outcome="admitted") == 1  # fmt: skip
    assert value(found, requests, tenant=UNKNOWN_TENANT, tier=UNKNOWN_TENANT, pool="none",
                 outcome="unauthorized") == 1  # fmt: skip
    assert value(found, "extproc_queued_requests", tenant="initech", tier="standard") == 1
    assert value(found, "extproc_queued_requests", tenant="acme", tier="premium") == 0
    assert value(found, "extproc_pool_queued_requests", pool="short") == 1
    assert value(found, "extproc_pool_inflight_requests", pool="short") == 1
    assert value(found, "extproc_pool_inflight_tokens", pool="short") > 0
    assert value(found, "extproc_pool_max_inflight_requests", pool="short") == 1
    assert value(found, "extproc_tenant_inflight_requests", tenant="acme", tier="premium") == 1
    assert value(found, "extproc_tokens_total", tenant="globex", direction="input") == 9
    assert value(found, "extproc_tokens_total", tenant="globex", direction="output") == 4
    assert value(found, "extproc_queue_wait_seconds_count", tenant="globex", tier="standard") == 1
    assert value(found, "extproc_ttft_seconds_count", tenant="globex", pool="short") == 1
    assert any(name == "extproc_estimation_error_ratio_count" for name, _ in found)
    assert value(found, "extproc_tenant_bucket_level", tenant="globex", bucket="requests") > 0
    assert (
        "extproc_tenant_fair_share",
        frozenset({("tenant", "globex"), ("pool", "short")}),
    ) in found
    assert value(found, "extproc_policy_reloads_total", result="error") == 0
    assert value(found, "extproc_reclaimed_leases_total", pool="all") == 0
    assert value(found, "extproc_ready") == 1
    tenants = {dict(labels).get("tenant") for _, labels in found} - {None}
    assert tenants <= {*admin.gateway.policy.tenants, UNKNOWN_TENANT}
    assert "evil-tenant" not in text and "sk-client-chosen-value" not in text

    await holder.close()  # frees the slot: the queued request is admitted
    await holder.call.code()
    assert (await queued.read()).WhichOneof("response") == "request_body"
    await queued.close()
    await queued.call.code()


async def test_tenants_view_has_each_tenants_live_state(admin: Admin) -> None:
    await served_request(admin.stub, TEST_KEYS["globex"])
    status, view = await admin.get("/v1/tenants")
    assert status == 200
    assert set(view["tenants"]) == {"acme", "globex", "initech"}
    globex = view["tenants"]["globex"]
    assert globex["tier"] == "standard" and globex["weight"] == 1.0
    for key in ("queued", "inflight", "inflight_tokens", "buckets", "fair_share",
                "served_requests", "served_tokens"):  # fmt: skip
        assert key in globex, key
    assert globex["served_requests"] == 1 and globex["served_tokens"] > 0
    assert set(globex["buckets"]) == {"requests", "tokens"}
    assert set(globex["fair_share"]) == {"short", "long"}
    assert set(view["pools"]) == {"short", "long"}
    assert view["pools"]["short"]["max_inflight"] == 1
    assert view["policy"]["file"] == str(admin.path)


async def test_reload_endpoint_is_loopback_only_by_default(admin: Admin) -> None:
    async with admin.session.post(admin.url + "/v1/reload") as response:
        assert response.status == 200
        assert (await response.json())["result"] == "success"
    remote: Any = SimpleNamespace(remote="192.0.2.10")
    refused = await admin.server.reload(remote)
    assert refused.status == 403
    admin.server.allow_remote_reload = True
    allowed = await admin.server.reload(remote)
    assert allowed.status == 200
    assert is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("10.1.2.3") and not is_loopback(None) and not is_loopback("x")


def test_refresh_folds_tenants_outside_the_policy_into_unknown() -> None:
    metrics = Metrics()
    snapshot: dict[str, Any] = {
        "tenants": {
            "acme": {"tier": "premium", "queued": 2, "inflight": 1, "inflight_tokens": 10,
                     "served_tokens": 5, "buckets": {"tokens": 7.0}, "fair_share": {"short": 1.5}},
            "ghost": {"tier": None, "queued": 0, "inflight": 3, "inflight_tokens": 30,
                      "served_tokens": 9, "removed": True},
        },
        "pools": {"short": {"inflight": 4, "inflight_tokens": 40, "queued": 2,
                            "max_inflight": 8, "max_inflight_tokens": 100, "drain_rate": None}},
        "reclaimed_leases": 2,
    }  # fmt: skip
    metrics.refresh(snapshot, {"acme"})
    get = metrics.registry.get_sample_value
    assert get("extproc_tenant_inflight_requests", {"tenant": "unknown", "tier": "unknown"}) == 3
    assert get("extproc_tenant_inflight_requests", {"tenant": "ghost", "tier": "unknown"}) is None
    assert get("extproc_tenant_bucket_level", {"tenant": "acme", "bucket": "tokens"}) == 7.0
    assert get("extproc_reclaimed_leases_total", {"pool": "all"}) == 2
    # Counters only move forward, and per-pool totals are used when the snapshot has them.
    snapshot["pools"]["short"]["reclaimed_leases"] = 3
    metrics.refresh(snapshot, {"acme"})
    metrics.refresh(snapshot, {"acme"})
    assert get("extproc_reclaimed_leases_total", {"pool": "short"}) == 3
    # A tenant that disappears from the snapshot leaves no stale gauge behind.
    del snapshot["tenants"]["ghost"]
    metrics.refresh(snapshot, {"acme"})
    assert get("extproc_tenant_inflight_requests", {"tenant": "unknown", "tier": "unknown"}) is None


async def test_wait_for_policy_stays_unready_until_the_file_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("tiers: [oops\n")
    options = ServeOptions(
        policy=str(path), grpc="127.0.0.1:0", admin="127.0.0.1:0",
        reload_interval=0.05, wait_for_policy=True,
    )  # fmt: skip
    service = Service(options)
    task = asyncio.create_task(service.run())
    try:
        async with aiohttp.ClientSession() as session:

            async def readyz() -> int:
                while service.admin_port == 0:
                    await asyncio.sleep(0.01)
                url = f"http://127.0.0.1:{service.admin_port}/readyz"
                async with session.get(url) as response:
                    return response.status

            assert await asyncio.wait_for(readyz(), 10) == 503
            path.write_text(policy_yaml())

            async def until_ready() -> None:
                while await readyz() != 200:
                    await asyncio.sleep(0.02)

            await asyncio.wait_for(until_ready(), 10)
            assert service.gateway is not None and service.grpc_port > 0
    finally:
        service.request_stop()
        assert await asyncio.wait_for(task, 10) == 0
