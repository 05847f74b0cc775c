"""Admin HTTP server: metrics, health, readiness, live tenant state and policy reload.

Bound to loopback by default (`--admin`). In a container it binds 0.0.0.0 so that probes and
Prometheus reach it, but `POST /v1/reload` still answers only loopback peers unless
`allow_remote_reload` is set: reload is also reachable through SIGHUP and the file watcher.

| route             | answer                                                                 |
|-------------------|------------------------------------------------------------------------|
| GET  /healthz     | 200 while the process runs (liveness)                                  |
| GET  /readyz      | 200 with a valid policy and gRPC serving; 503 before that or draining  |
| GET  /metrics     | Prometheus text; live gauges refreshed from the scheduler snapshot     |
| GET  /v1/tenants  | JSON: each tenant's tier, weight, queued, in-flight, buckets, fair     |
|                   | share, tokens served; each pool's load and limits                      |
| POST /v1/reload   | re-read the policy file: 200 applied, 422 rejected (file:line errors)  |
| GET  /status      | live status page (HTML, polls /v1/status; extproc.status)              |
| GET  /v1/status   | JSON: per tier and tenant, per pool and engine, last rejections        |
"""

from __future__ import annotations

import ipaddress
import time
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.metrics import Metrics
from extproc.reload import PolicyReloader
from extproc.service.gateway import Gateway
from extproc.status.page import StatusRoutes


def _dumps(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=_dumps)


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class AdminServer:
    def __init__(
        self,
        gateway: Gateway | None = None,
        *,
        metrics: Metrics | None = None,
        reloader: PolicyReloader | None = None,
        allow_remote_reload: bool = False,
    ) -> None:
        self.gateway = gateway
        self.metrics = metrics or (gateway.metrics if gateway is not None else Metrics())
        self.reloader = reloader
        self.allow_remote_reload = allow_remote_reload
        self.draining = False
        self.serving = gateway is not None
        """True once the gRPC server accepts streams; `serve` sets it."""
        self.started_at = time.time()
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/tenants", self.tenants)
        app.router.add_post("/v1/reload", self.reload)
        self.status = StatusRoutes(
            gateway=lambda: self.gateway,
            metrics=lambda: self.metrics,
            reloader=lambda: self.reloader,
            draining=lambda: self.draining,
        )
        self.status.add_to(app)
        self.app = app
        self._runner: web.AppRunner | None = None

    # -- state ------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.gateway is not None and self.serving and not self.draining

    def _policy_info(self) -> dict[str, Any]:
        gateway = self.gateway
        info: dict[str, Any] = {"file": gateway.policy.file if gateway else None}
        if self.reloader is not None:
            info["fingerprint"] = self.reloader.fingerprint or None
            last = self.reloader.last_result
            info["last_reload"] = last.as_json() if last is not None else None
        return info

    # -- routes -----------------------------------------------------------------------------------

    async def healthz(self, _: web.Request) -> web.Response:
        return _json({"status": "ok", "uptime_s": round(time.time() - self.started_at, 3)})

    async def readyz(self, _: web.Request) -> web.Response:
        if self.draining:
            return _json({"status": "draining"}, status=503)
        if self.gateway is None:
            return _json({"status": "starting", "reason": "no valid policy loaded"}, status=503)
        if not self.serving:
            return _json({"status": "starting", "reason": "gRPC server not started"}, status=503)
        return _json({"status": "ready", "policy": self._policy_info()})

    async def metrics_page(self, _: web.Request) -> web.Response:
        gateway = self.gateway
        if gateway is not None:
            self.metrics.refresh(gateway.scheduler.snapshot(), gateway.policy.tenants.keys())
            self.metrics.policy_tenants.set(len(gateway.policy.tenants))
        self.metrics.ready.set(1 if self.ready else 0)
        self.metrics.draining.set(1 if self.draining else 0)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def tenants(self, _: web.Request) -> web.Response:
        gateway = self.gateway
        if gateway is None:
            return _json({"error": "no valid policy loaded"}, status=503)
        snapshot = gateway.scheduler.snapshot()
        return _json(
            {
                "policy": self._policy_info(),
                "fairness": snapshot.get("fairness"),
                "queued": snapshot.get("queued", 0),
                "inflight": snapshot.get("leases", 0),
                "reclaimed_leases": snapshot.get("reclaimed_leases", 0),
                "draining": self.draining,
                "tenants": snapshot.get("tenants", {}),
                "pools": snapshot.get("pools", {}),
                "locality": snapshot.get("locality"),
                "state": gateway.state_view(),
            }
        )

    async def reload(self, request: web.Request) -> web.Response:
        if not self.allow_remote_reload and not is_loopback(request.remote):
            return _json(
                {"error": "reload is allowed from loopback only (or send SIGHUP)"}, status=403
            )
        if self.reloader is None or self.gateway is None:
            return _json({"error": "no policy loaded yet; fix the file, it is watched"}, 503)
        result = await self.reloader.reload_async("admin")
        return _json(result.as_json(), status=200 if result.ok else 422)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self, address: str) -> int:
        host, _, port = address.rpartition(":")
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host.strip("[]"), int(port))
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else int(port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
