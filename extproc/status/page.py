"""The admin server's status routes: the page (`GET /status`, package data, no build step, no
external assets) and its JSON (`GET /v1/status`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from extproc.metrics import Metrics
from extproc.reload import PolicyReloader
from extproc.status.engines import EngineReader
from extproc.status.view import StatusView

if TYPE_CHECKING:
    from extproc.service.gateway import Gateway

ASSETS = {
    "status.js": "text/javascript",
    "status.css": "text/css",
}
_PAGE = "index.html"
# The page loads only its own script and style from this server and reads only /v1/status.
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}


@cache
def asset(name: str) -> bytes:
    return resources.files("extproc.status").joinpath("static", name).read_bytes()


class StatusRoutes:
    """Reads the admin server's gateway, metrics and reloader at each request (the service
    sets them once a valid policy is loaded)."""

    def __init__(
        self,
        gateway: Callable[[], Gateway | None],
        metrics: Callable[[], Metrics],
        reloader: Callable[[], PolicyReloader | None],
        draining: Callable[[], bool],
        view: StatusView | None = None,
    ) -> None:
        self.gateway = gateway
        self.metrics = metrics
        self.reloader = reloader
        self.draining = draining
        self.view = view or StatusView()
        self._engines: EngineReader | None = None
        self._engines_of: Gateway | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/status", self.page)
        app.router.add_get("/status/{asset}", self.asset)
        app.router.add_get("/v1/status", self.status)

    def engines(self, gateway: Gateway) -> EngineReader:
        """The engine reader of this gateway, subscribed to its poller on first use."""
        if self._engines is None or self._engines_of is not gateway:
            if self._engines is not None and self._engines_of is not None:
                self._engines_of.engine_poller.unsubscribe(self._engines)
            reader = EngineReader(
                lambda: {name: list(pool.endpoints) for name, pool in gateway.policy.pools.items()}
            )
            gateway.engine_poller.subscribe(reader)
            self._engines, self._engines_of = reader, gateway
        return self._engines

    async def page(self, _: web.Request) -> web.Response:
        return web.Response(
            body=asset(_PAGE), content_type="text/html", charset="utf-8", headers=_HEADERS
        )

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["asset"]
        content_type = ASSETS.get(name)
        if content_type is None:
            raise web.HTTPNotFound()
        return web.Response(
            body=asset(name), content_type=content_type, charset="utf-8", headers=_HEADERS
        )

    async def status(self, _: web.Request) -> web.Response:
        gateway = self.gateway()
        if gateway is None:
            return json_response({"error": "no valid policy loaded"}, 503)
        engines = self.engines(gateway)
        engines.watched()
        body = self.view.build(
            gateway.policy,
            gateway.scheduler.snapshot(),
            self.metrics(),
            reloader=self.reloader(),
            engines=engines,
            rejections=gateway.recent_rejections(),
            overload=gateway.overload.describe(),
            draining=self.draining(),
        )
        return json_response(body)


def json_response(data: Any, status: int = 200) -> web.Response:
    body = orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS)
    return web.Response(
        body=body,
        status=status,
        content_type="application/json",
        headers={"Cache-Control": "no-cache"},
    )
