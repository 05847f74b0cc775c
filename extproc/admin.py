"""Admin HTTP server: metrics, health, readiness and live tenant state. Loopback by default."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.service.gateway import Gateway

_JSON = "application/json"


class AdminServer:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.draining = False
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/tenants", self.tenants)
        self.app = app
        self._runner: web.AppRunner | None = None

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, _: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ready", "policy": self.gateway.policy.file})

    async def metrics(self, _: web.Request) -> web.Response:
        self.gateway.refresh_gauges()
        body = generate_latest(self.gateway.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def tenants(self, _: web.Request) -> web.Response:
        return web.json_response(self.gateway.tenants_view())

    async def start(self, address: str) -> int:
        host, _, port = address.rpartition(":")
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host.strip("[]"), int(port))
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else int(port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
