"""The admin server's status routes: the page and its assets come from the package, load
nothing from elsewhere, and the JSON answers once a policy is loaded."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from extproc.admin import AdminServer
from extproc.policy import load_policy
from extproc.service.composition import compose
from extproc.status.page import ASSETS, asset
from tests.conftest import policy_yaml

SVG_NAMESPACE = "http://www.w3.org/2000/svg"
TIMEOUT = aiohttp.ClientTimeout(total=10)


@pytest.fixture
async def admin(tmp_path: Path) -> AsyncIterator[tuple[AdminServer, str]]:
    server = AdminServer()
    port = await server.start("127.0.0.1:0")
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()
        if server.gateway is not None:
            await server.gateway.close()


async def get(url: str) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.get(url) as response,
    ):
        return response.status, dict(response.headers), await response.read()


def test_the_page_references_nothing_outside_this_server() -> None:
    for name in ("index.html", *ASSETS):
        text = asset(name).decode()
        urls = set(re.findall(r"[a-z]+://[^\s\"'`)]+", text)) - {SVG_NAMESPACE}
        assert not urls, (name, urls)
        assert not re.search(r"""(src|href)=["']//""", text), name
        assert "@import" not in text and "url(" not in text, name
    page = asset("index.html").decode()
    assert re.findall(r"""(?:src|href)="([^"]+)\"""", page) == [
        "/status/status.css", "/status/status.js",
    ]  # fmt: skip


async def test_the_page_and_its_assets_are_served_with_a_same_origin_policy(
    admin: tuple[AdminServer, str],
) -> None:
    _, url = admin
    status, headers, body = await get(url + "/status")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert b'id="tenant-rows"' in body
    for name, kind in ASSETS.items():
        status, headers, body = await get(f"{url}/status/{name}")
        assert status == 200, name
        assert headers["Content-Type"].startswith(kind)
        assert body == asset(name)
    status, _, _ = await get(url + "/status/secrets.txt")
    assert status == 404
    status, _, _ = await get(url + "/status/..%2F__init__.py")
    assert status == 404


async def test_the_json_waits_for_a_policy_then_answers(
    admin: tuple[AdminServer, str], tmp_path: Path
) -> None:
    server, url = admin
    status, _, body = await get(url + "/v1/status")
    assert status == 503
    assert orjson.loads(body) == {"error": "no valid policy loaded"}
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml())
    server.gateway = compose(load_policy(path), metrics=server.metrics)  # as Service does
    server.gateway.metrics.requests_of("acme", "premium", "short", "admitted").inc(2)
    status, headers, body = await get(url + "/v1/status")
    assert status == 200
    assert headers["Cache-Control"] == "no-cache"
    view = orjson.loads(body)
    assert [tier["name"] for tier in view["tiers"]] == ["premium", "standard"]
    assert view["tiers"][0]["tenants"][0]["admitted"] == 2
    assert {pool["name"] for pool in view["pools"]} == {"short", "long"}
    assert view["pools"][0]["engines"][0]["age_s"] is None  # subscribed, not read yet
    server.draining = True
    status, _, body = await get(url + "/v1/status")
    assert orjson.loads(body)["draining"] is True
