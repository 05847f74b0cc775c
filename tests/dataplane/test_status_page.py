"""The admin status page in a real browser (headless Debian chromium) on a real stack: its
numbers move when traffic starts and when a flood queues.

SAVE_STATUS_SCREENSHOT=PATH also saves the screenshot taken under the flood to PATH (the one in
docs/img/status.png was made so).
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as DriverService
from selenium.webdriver.remote.webdriver import WebDriver

from tests.conftest import policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.dataplane.test_admission import chat, send

pytestmark = pytest.mark.dataplane

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOT_ENV = "SAVE_STATUS_SCREENSHOT"
DOM_TIMEOUT_S = 30.0
# About 1.5 s per request on the "fast" engine profile (1 ms steps): the flood stays queued for
# several of the page's one-second updates.
FLOOD, FLOOD_TOKENS = 16, 1500
SMALL_QUEUE = "{requests_per_minute: 6000, tokens_per_minute: 10000000, max_queued: 3}"
LARGE_QUEUE = "{requests_per_minute: 6000, tokens_per_minute: 10000000, max_queued: 200}"


def status_policy(short: str, long_: str) -> str:
    text = policy_yaml(
        short,
        long_,
        acme_limits=LARGE_QUEUE,
        globex_limits=LARGE_QUEUE,
        initech_limits=SMALL_QUEUE,
        short_inflight=3,
        long_inflight=2,
    )
    # The short pool's limit adapts (from 1 up to 3), so the page has a limit history to draw.
    static = f'    endpoints: ["{short}"]\n    headroom: 0\n    adaptive: {{enabled: false}}\n'
    adaptive = "    adaptive: {min_inflight: 1, initial_inflight: 1, poll_interval: 200ms}\n"
    assert static in text
    return text.replace(static, f'    endpoints: ["{short}"]\n    headroom: 0\n' + adaptive)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    with running_gateway(tmp_path_factory.mktemp("status"), status_policy) as running:
        yield running


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    for binary in (CHROMIUM, CHROMEDRIVER):
        if not Path(binary).exists():
            message = f"{binary} is missing: apt-get install chromium chromium-driver"
            if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
                pytest.fail(message)  # .ci/run installs them
            pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run",
        "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1400,1000",
    ):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(service=DriverService(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """Reads the status page's DOM; waits are polls of the DOM with a deadline."""

    def __init__(self, driver: WebDriver) -> None:
        self.driver = driver

    def text(self, selector: str) -> str | None:
        found = self.driver.execute_script(
            "const n = document.querySelector(arguments[0]); return n ? n.textContent : null;",
            selector,
        )
        return None if found is None else str(found)

    def number(self, selector: str) -> float | None:
        """A cell's number ("1,234" reads 1234); None for a missing cell or a dash."""
        text = self.text(selector)
        if text is None:
            return None
        head = text.strip().split(" ")[0].replace(",", "")
        try:
            return float(head)
        except ValueError:
            return None

    def tenant(self, name: str, field: str) -> float | None:
        return self.number(f'tr[data-tenant="{name}"] [data-field="{field}"]')

    def pool(self, name: str, field: str) -> float | None:
        return self.number(f'[data-pool="{name}"] [data-field="{field}"]')

    def state(self) -> str:
        return str(self.driver.execute_script("return document.body.innerText;"))

    def wait(self, what: str, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + DOM_TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never showed {what}; it reads:\n{self.state()}")
            time.sleep(0.05)  # the DOM poll interval, not a synchronisation

    def screenshot(self, path: Path) -> None:
        """The whole page, beyond the window's height too."""
        shot = self.driver.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
        )
        path.write_bytes(base64.b64decode(shot["data"]))


def at_least(value: float | None, floor: float) -> bool:
    return value is not None and value >= floor


async def in_browser(page: Page, what: str, condition: Callable[[], bool]) -> None:
    """Wait on the DOM in a thread, so the event loop keeps driving the traffic."""
    await asyncio.to_thread(page.wait, what, condition)


async def test_the_numbers_move_with_traffic_and_a_flood(
    gateway: RunningGateway, browser: WebDriver, tmp_path: Path
) -> None:
    page = Page(browser)
    browser.get(gateway.admin_url + "/status")
    await in_browser(
        page,
        "the first update, with every tenant idle",
        lambda: (
            page.text("#updated[data-generated-at]") is not None
            and page.tenant("globex", "admitted") == 0
            and page.tenant("acme", "admitted") == 0
            and page.pool("short", "queued") == 0
        ),
    )
    assert page.text('tr[data-tier="premium"]') == "premium"
    assert page.text('[data-field="fairness"]') == "drr"
    overload = page.text('[data-field="overload"]') or ""
    # No CPU-wait reading: this policy leaves `cpu_wait_fraction` out.
    shown = r"(keeping up|shedding \(\w+\)[\w ,-]*) \(loop lag [\d.]+ m?s\)"
    assert re.fullmatch(shown, overload), overload

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # Traffic starts: admissions are counted, tokens flow, and the streamed responses
        # give an inter-token latency.
        assert (
            page.text('tr[data-tenant="acme"] [data-field="inter-token"]') == "\u2013 / \u2013"
        )  # en dashes: no figure yet
        answers = [await send(session, gateway, "acme", chat(24, stream=True)) for _ in range(3)]
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert all(b"data: [DONE]" in body for _, _, body in answers)
        await in_browser(
            page,
            "acme's three admissions, its output tokens per second and its inter-token latency",
            lambda: (
                page.tenant("acme", "admitted") == 3
                and at_least(page.tenant("acme", "tokens-out"), 1)
                and at_least(page.tenant("acme", "tokens-in"), 1)
                and (page.tenant("acme", "inter-token") or 0.0) > 0.0
            ),
        )
        inter_token = page.text('tr[data-tenant="acme"] [data-field="inter-token"]') or ""
        assert inter_token.count(" ms") + inter_token.count(" s") == 2, inter_token
        engine = '[data-pool="short"] [data-engine] [data-field="running"]'
        await in_browser(
            page, "a reading of the short pool's engine", lambda: page.number(engine) is not None
        )

        # A flood queues: the flooder's queue and the pool's queue show it, and a tenant with a
        # small queue is refused with "queue full".
        flood = [
            asyncio.create_task(send(session, gateway, "globex", chat(FLOOD_TOKENS)))
            for _ in range(FLOOD)
        ]
        await in_browser(
            page,
            "globex's queue under the flood",
            lambda: (
                at_least(page.tenant("globex", "queued"), 5)
                and at_least(page.pool("short", "queued"), 5)
                and at_least(page.pool("short", "inflight"), 1)
            ),
        )
        overflow = [
            asyncio.create_task(send(session, gateway, "initech", chat(8))) for _ in range(8)
        ]
        await in_browser(
            page,
            "initech's queue-full rejections in its row and in the rejection log",
            lambda: (
                at_least(page.tenant("initech", "rejected"), 1)
                and "queue full" in (page.text("#rejection-rows") or "")
            ),
        )
        # The service's own record of the rejection: who, the status and its Retry-After.
        refusal = 'tr[data-outcome="rejected_queue_full"]'
        assert page.text(f'{refusal} [data-field="tenant"]') == "initech"
        assert page.text(f'{refusal} [data-field="status"]') == "429"
        assert at_least(page.number(f'{refusal} [data-field="retry-after"]'), 1)
        assert (page.text(f'{refusal} [data-field="retry-after"]') or "").endswith(" s")
        shot = tmp_path / "status.png"
        page.screenshot(shot)
        wanted = os.environ.get(SCREENSHOT_ENV)
        if wanted:
            shutil.copyfile(shot, wanted)
        refused = sum(status == 429 for status, _, _ in await asyncio.gather(*overflow))
        flooded = await asyncio.gather(*flood)
    assert [status for status, _, _ in flooded] == [200] * FLOOD
    assert refused >= 1

    # The flood drains: the queue empties and every request is counted as admitted.
    await in_browser(
        page,
        "the flood drained",
        lambda: (
            page.tenant("globex", "queued") == 0
            and page.tenant("globex", "admitted") == FLOOD
            and page.pool("short", "queued") == 0
            and page.tenant("initech", "rejected") == refused
            and page.tenant("initech", "admitted") == 8 - refused
        ),
    )
    history = history_points(browser)
    assert history >= 2, history
    assert shot.stat().st_size > 10_000


def history_points(driver: WebDriver) -> Any:
    """Points in the short pool's limit chart (one polyline per series)."""
    return driver.execute_script(
        "const line = document.querySelector('[data-pool=\"short\"] svg polyline');"
        "return line ? line.getAttribute('points').split(' ').length : 0;"
    )
