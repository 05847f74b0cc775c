"""`extproc up --demo`: show requests going through the running gateway, then stop."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

DEMO_KEYS = {"acme": "demo-acme-key", "globex": "demo-globex-key"}


def _post(url: str, key: str | None, body: dict[str, object]) -> tuple[int, dict[str, str], bytes]:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers.items()), error.read()


def _usage_total(events: list[str]) -> int | None:
    """total_tokens of the stream's usage chunk, if it has one."""
    for line in reversed(events):
        payload = line.removeprefix("data:").strip()
        if payload.startswith("{"):
            usage = json.loads(payload).get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("total_tokens"), int):
                return int(usage["total_tokens"])
    return None


def _settled_tokens(admin_url: str, tenant: str, timeout_s: float = 10.0) -> int | None:
    """The tenant's served tokens once nothing of it is in flight (its account settled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{admin_url}/v1/tenants", timeout=5) as response:
            state = json.loads(response.read())["tenants"][tenant]
        if state["inflight"] == 0:
            return int(state["served_tokens"])
        time.sleep(0.05)
    return None


def _settled_everywhere(admin_urls: Sequence[str], tenant: str) -> int | None:
    """The tenant's settled tokens summed over the service's processes (each counts the
    requests it admitted: one per worker of `--workers N`)."""
    total = 0
    for url in admin_urls:
        settled = _settled_tokens(url, tenant)
        if settled is None:
            return None
        total += settled
    return total


def run_demo(base_url: str, admin_urls: Sequence[str] = ()) -> int:
    chat = f"{base_url}/v1/chat/completions"
    message = {"role": "user", "content": "Say hello to the fair gateway."}
    started = time.monotonic()
    status, headers, body = _post(
        chat, DEMO_KEYS["acme"], {"model": "demo", "messages": [message], "max_tokens": 12}
    )
    elapsed = (time.monotonic() - started) * 1000
    print(f"\nPOST /v1/chat/completions as acme -> {status} in {elapsed:.0f} ms")
    print(f"  served by engine {headers.get('x-engine-id')}, "
          f"remaining requests {headers.get('x-ratelimit-remaining-requests')}")  # fmt: skip
    print(f"  {body.decode()[:300]}")
    ok = status == 200

    status, headers, body = _post(
        chat,
        DEMO_KEYS["globex"],
        {"model": "demo", "messages": [message], "max_tokens": 8, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    events = [line for line in body.decode().splitlines() if line.startswith("data:")]
    print(f"\nstreamed POST as globex -> {status}, {len(events)} SSE events; last two:")
    for line in events[-2:]:
        print(f"  {line[:200]}")
    ok = ok and status == 200 and events[-1] == "data: [DONE]"
    if admin_urls:
        # Every token counted: the tenant's account holds what the engine's usage reported.
        usage, settled = _usage_total(events), _settled_everywhere(admin_urls, "globex")
        print(f"  globex's account: {settled} tokens settled, the stream's usage says {usage}")
        ok = ok and usage is not None and settled == usage

    status, _, body = _post(chat, "not-a-key", {"model": "demo", "messages": [message]})
    print(f"\nPOST with an unknown key -> {status} {body.decode()}")
    ok = ok and status == 401
    print("\ndemo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1
