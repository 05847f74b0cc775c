"""Policy hot reload: valid versions apply to the next request, invalid ones are rejected with
file:line errors and counted while the last good policy stays in force, removed tenants' queued
requests get a clear error; the file watcher, SIGHUP and POST /v1/reload all trigger it."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from ruamel.yaml import YAML

import extproc.reload as reload_module
from extproc.policy import PolicyFile, load_policy
from extproc.reload import PolicyReloader
from extproc.service.composition import compose
from extproc.service.gateway import Gateway
from extproc.service.logs import JsonFormatter
from extproc.service.server import start_grpc_server
from tests.adversarial.yaml_bombs import BILLION_LAUGHS
from tests.conftest import TEST_KEYS, policy_yaml
from tests.grpc.test_extproc_stream import (
    EnvoyPeer,
    body_message,
    chat_body,
    headers_message,
    response_ends,
    set_headers,
)
from tests.serve_support import get_json, http, serve_process, wait_for

CHAT = "/v1/chat/completions"


def edit_policy(text: str, edit: dict[str, object] | None = None, drop: str | None = None) -> str:
    """The policy text with `tenants.<name>` fields changed or one tenant removed."""
    yaml = YAML()
    data = yaml.load(text)
    for dotted, value in (edit or {}).items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    if drop is not None:
        del data["tenants"][drop]
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def replace_file(path: Path, text: str) -> None:
    """Write the way editors do: a new file renamed over the old one (new inode)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def reload_count(gateway: Gateway, result: str) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "extproc_policy_reloads_total", {"result": result}
    )
    return value or 0.0


@dataclass
class Running:
    gateway: Gateway
    reloader: PolicyReloader
    stub: ext_proc_grpc.ExternalProcessorStub
    path: Path


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml(short_inflight=1))
    gateway = compose(load_policy(path))
    reloader = PolicyReloader(str(path), gateway.apply_policy, gateway.metrics, interval_s=0.05)
    reloader.mark_loaded(path.read_text())
    server, port = await start_grpc_server(gateway, "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Running(gateway, reloader, ext_proc_grpc.ExternalProcessorStub(channel), path)
    finally:
        await reloader.stop()
        await channel.close()
        await server.stop(None)


async def tier_of_next_request(stub: ext_proc_grpc.ExternalProcessorStub, key: str) -> str:
    peer = EnvoyPeer(stub)
    await peer.send(headers_message("POST", CHAT, key))
    reply = await peer.send(body_message(chat_body()))
    assert reply.WhichOneof("response") == "request_body", reply
    await peer.close()
    await peer.call.code()
    await response_ends(stub, reply)
    return set_headers(reply, "request_body")["x-tier"]


async def test_valid_change_applies_to_the_next_request(running: Running) -> None:
    assert await tier_of_next_request(running.stub, TEST_KEYS["globex"]) == "standard"
    running.path.write_text(
        edit_policy(running.path.read_text(), {"tenants.globex.tier": "premium"})
    )
    result = running.reloader.reload("test")
    assert result.result == "success" and result.removed_queued == 0
    assert await tier_of_next_request(running.stub, TEST_KEYS["globex"]) == "premium"
    assert reload_count(running.gateway, "success") == 1


async def test_invalid_version_keeps_last_good_and_is_counted_with_file_line(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    good = running.path.read_text()
    bad = edit_policy(good, {"tenants.globex.tier": "gold"})
    line = next(i for i, text in enumerate(bad.splitlines(), 1) if "gold" in text)
    running.path.write_text(bad)
    with caplog.at_level(logging.ERROR, logger="extproc.reload"):
        result = running.reloader.reload("test")
    assert result.result == "error"
    assert any(f"{running.path}:{line}: tenants.globex.tier" in e for e in result.errors)
    assert reload_count(running.gateway, "error") == 1
    assert reload_count(running.gateway, "success") == 0
    # The log line is one JSON object naming file:line.
    record = next(r for r in caplog.records if r.name == "extproc.reload")
    entry = orjson.loads(JsonFormatter().format(record))
    assert entry["level"] == "error" and entry["result"] == "error"
    assert f"{running.path}:{line}:" in entry["message"]
    assert any(f"{running.path}:{line}:" in e for e in entry["errors"])
    # The last good policy is still in force.
    assert await tier_of_next_request(running.stub, TEST_KEYS["globex"]) == "standard"
    assert running.gateway.policy.tenants["globex"].tier == "standard"


async def test_removed_tenant_queued_requests_get_a_clear_error(running: Running) -> None:
    first = EnvoyPeer(running.stub)  # takes the short pool's only slot
    await first.send(headers_message("POST", CHAT, TEST_KEYS["globex"]))
    assert (await first.send(body_message(chat_body()))).WhichOneof("response") == "request_body"
    queued = EnvoyPeer(running.stub)
    await queued.send(headers_message("POST", CHAT, TEST_KEYS["initech"]))
    assert (await queued.send(body_message(chat_body()))).HasField("override_message_timeout")
    assert running.gateway.scheduler.snapshot()["tenants"]["initech"]["queued"] == 1

    running.path.write_text(edit_policy(running.path.read_text(), drop="initech"))
    result = running.reloader.reload("test")
    assert result.result == "success" and result.removed_queued == 1

    answer = await queued.read()
    assert answer.WhichOneof("response") == "immediate_response"
    assert answer.immediate_response.status.code == 403
    error = orjson.loads(answer.immediate_response.body)["error"]
    assert "removed from the policy" in error["message"]
    await queued.close()
    await first.close()
    await first.call.code()
    # A new request of the removed tenant is now unknown.
    peer = EnvoyPeer(running.stub)
    reply = await peer.send(headers_message("POST", CHAT, TEST_KEYS["initech"]))
    assert reply.immediate_response.status.code == 401
    await peer.close()


async def test_watcher_follows_an_editor_replacing_the_file(running: Running) -> None:
    running.reloader.start()
    replace_file(
        running.path, edit_policy(running.path.read_text(), {"tenants.globex.weight": 3.0})
    )

    async def applied() -> None:
        while running.gateway.policy.tenants["globex"].weight != 3.0:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(applied(), 10)
    assert running.reloader.last_result is not None
    assert running.reloader.last_result.trigger == "watch"

    # A broken write is rejected by the watcher too, and the good version stays.
    replace_file(running.path, "tenants: [not, a, mapping\n")

    async def rejected() -> None:
        while reload_count(running.gateway, "error") < 1:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(rejected(), 10)
    assert running.gateway.policy.tenants["globex"].weight == 3.0


async def test_watcher_ignores_a_touch_that_changes_nothing(running: Running) -> None:
    running.reloader.start()
    stat = running.path.stat()
    os.utime(running.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))

    async def seen() -> None:
        while reload_count(running.gateway, "unchanged") < 1:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(seen(), 10)
    assert reload_count(running.gateway, "success") == 0


def test_sighup_and_admin_reload_in_a_running_service(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml())
    # --reload-interval 0: no watcher, so only SIGHUP and POST /v1/reload reload.
    with serve_process(policy, tmp_path, "--reload-interval", "0") as served:
        tenants = served.admin_url + "/v1/tenants"
        policy.write_text(edit_policy(policy.read_text(), {"tenants.globex.weight": 4.0}))
        served.signal(signal.SIGHUP)
        wait_for(lambda: get_json(tenants)[1]["tenants"]["globex"]["weight"] == 4.0, "SIGHUP")

        policy.write_text(edit_policy(policy.read_text(), {"tenants.globex.weight": -1}))
        status, _, body = http("POST", served.admin_url + "/v1/reload")
        answer = orjson.loads(body)
        assert status == 422 and answer["result"] == "error"
        assert all(e.startswith(f"{policy}:") for e in answer["errors"])
        assert get_json(tenants)[1]["tenants"]["globex"]["weight"] == 4.0

        policy.write_text(edit_policy(policy.read_text(), {"tenants.globex.weight": 5.0}))
        status, _, body = http("POST", served.admin_url + "/v1/reload")
        assert status == 200 and orjson.loads(body)["result"] == "success"
        assert get_json(tenants)[1]["tenants"]["globex"]["weight"] == 5.0

        _, _, metrics = http("GET", served.admin_url + "/metrics")
        text = metrics.decode()
        assert 'extproc_policy_reloads_total{result="success"} 2.0' in text
        assert 'extproc_policy_reloads_total{result="error"} 1.0' in text
        served.signal(signal.SIGTERM)
        assert served.wait(20) == 0
    rejected = [e for e in served.log_lines() if e.get("result") == "error"]
    assert rejected and rejected[0]["level"] == "error"
    assert rejected[0]["errors"][0].startswith(f"{policy}:")


async def test_reload_beyond_the_running_envoys_hold_limit_is_refused(running: Running) -> None:
    """The Envoy in front was rendered for waits of 30 s (max_message_timeout 60 s): a longer
    wait would be held with an override Envoy ignores, and the client would get an empty 504
    after message_timeout. Refused with file:line:field, the last good policy stays."""
    assert running.reloader.envoy_hold_limit_s == 60.0
    longer = edit_policy(running.path.read_text(), {"tenants.acme.limits.max_queue_wait": "2m"})
    line = next(i for i, text in enumerate(longer.splitlines(), 1) if "max_queue_wait" in text)
    running.path.write_text(longer)
    result = running.reloader.reload("test")
    assert result.result == "error"
    assert result.errors == (
        f"{running.path}:{line}: tenants.acme.limits.max_queue_wait: a hold of 125s "
        "(max_queue_wait + 5s) exceeds the running Envoy's max_message_timeout of 60s: lower "
        "it, or re-render Envoy with a larger gateway.max_message_timeout and restart it first",
    )
    assert reload_count(running.gateway, "error") == 1
    assert running.gateway.policy.tenants["acme"].limits.max_queue_wait == 30.0
    within = edit_policy(longer, {"tenants.acme.limits.max_queue_wait": "55s"})
    running.path.write_text(within)
    assert running.reloader.reload("test").result == "success"
    assert running.gateway.policy.tenants["acme"].limits.max_queue_wait == 55.0


async def test_bomb_reload_leaves_the_event_loop_serving(running: Running) -> None:
    """A 254-byte alias bomb blocked the loop for ~19 s; now it is refused with its line,
    off the loop, while requests keep being admitted."""
    running.path.write_text(BILLION_LAUGHS)
    reload = asyncio.create_task(running.reloader.reload_async("test"))
    tier = await asyncio.wait_for(tier_of_next_request(running.stub, TEST_KEYS["globex"]), 5)
    result = await asyncio.wait_for(reload, 5)
    assert tier == "standard"
    assert result.result == "error"
    assert result.errors == (
        f"{running.path}:6: expands to more than 250000 nodes (aliases nest too deep)",
    )
    assert running.gateway.policy.tenants["globex"].tier == "standard"


async def test_slow_reload_times_out_and_keeps_last_good(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever makes reading slow, the reload answers after parse_timeout_s and the loop
    serves meanwhile."""
    release = threading.Event()
    real_parse = reload_module.parse_policy

    def stuck(text: str, file: str = "<policy>") -> PolicyFile:
        release.wait(10)
        return real_parse(text, file)

    monkeypatch.setattr(reload_module, "parse_policy", stuck)
    running.reloader.parse_timeout_s = 0.3
    running.path.write_text(
        edit_policy(running.path.read_text(), {"tenants.globex.tier": "premium"})
    )
    try:
        reload = asyncio.create_task(running.reloader.reload_async("test"))
        tier = await asyncio.wait_for(tier_of_next_request(running.stub, TEST_KEYS["globex"]), 5)
        result = await asyncio.wait_for(reload, 5)
    finally:
        release.set()
    assert tier == "standard"
    assert result.result == "error"
    assert result.errors == (f"{running.path}:1: reading the policy took longer than 0.3s",)
    assert running.gateway.policy.tenants["globex"].tier == "standard"
    assert reload_count(running.gateway, "error") == 1
