"""A do-nothing HTTP receiver of Envoy's events for `extproc bench envoy-counting`: it reads
each POST to /events and answers 204, and says how many it got at GET /count. What the
service would pay, at least, to hear from a counting script in Envoy.

`python -m gateway_lab.bench.event_sink --listen 127.0.0.1:PORT`
"""

from __future__ import annotations

import argparse
import asyncio

import uvloop
from aiohttp import web

from extproc.envoy_config import split_host_port

RECEIVED = web.AppKey("received", list[int])


async def _event(request: web.Request) -> web.Response:
    await request.read()
    request.app[RECEIVED][0] += 1
    return web.Response(status=204)


async def _count(request: web.Request) -> web.Response:
    return web.Response(text=str(request.app[RECEIVED][0]))


def application() -> web.Application:
    app = web.Application()
    app[RECEIVED] = [0]
    app.router.add_post("/events", _event)
    app.router.add_get("/count", _count)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT (loopback)")
    args = parser.parse_args(argv)
    host, port = split_host_port(args.listen)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # as the service runs
    web.run_app(application(), host=host, port=port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
