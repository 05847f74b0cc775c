"""gateway_lab.vllm_cpu.stack without vLLM: engine shapes, commands, readiness, stopping (fast)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from extproc.policy import Policy, load_policy
from gateway_lab.processes import Child, Stack
from gateway_lab.vllm_cpu import stack as vstack
from gateway_lab.vllm_cpu.launcher import ACCEPT_ANY_MODEL_ENV, VllmStartError
from gateway_lab.vllm_cpu.model_builder import DEFAULT_SPEC, MARKER_FILE, _marker_text, model_dir
from tests.conftest import free_port, policy_yaml


def _policy(tmp_path: Path, short_tokens: int = 2048, long_tokens: int = 16384) -> Policy:
    text = policy_yaml(f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    text = text.replace("max_total_tokens: 2048", f"max_total_tokens: {short_tokens}")
    text = text.replace("max_total_tokens: 16384", f"max_total_tokens: {long_tokens}")
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return load_policy(path)


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_engine_specs_shape_each_pool(tmp_path: Path) -> None:
    policy = _policy(tmp_path, long_tokens=131072)
    specs = {spec.pool: spec for spec in vstack.engine_specs(policy, cores=[0, 1])}
    short, long_ = specs["short"], specs["long"]
    assert short.preset.max_num_seqs == 32 and long_.preset.max_num_seqs == 8
    assert short.preset.max_model_len == 2048
    assert long_.preset.max_model_len == vstack.MODEL_MAX_LEN == 16384  # capped at the model
    for spec in specs.values():
        assert spec.preset.kv_cache_blocks is not None
        assert (spec.preset.kv_cache_blocks - 1) * 128 >= spec.preset.max_model_len
    assert {short.preset.cpu_bind, long_.preset.cpu_bind} == {"0", "1"}
    endpoint = policy.pools["short"].endpoints[0]
    assert short.health_url == f"http://{endpoint}/health"
    assert vstack.readiness_urls(policy) == [(s.health_url, s.name) for s in specs.values()]


def test_one_core_pins_every_engine_to_it(tmp_path: Path) -> None:
    specs = vstack.engine_specs(_policy(tmp_path), cores=[3])
    assert [s.preset.cpu_bind for s in specs] == ["3", "3"]


def test_children_serve_several_names_from_the_given_python(tmp_path: Path) -> None:
    policy = _policy(tmp_path)
    messages: list[str] = []
    children = vstack.vllm_children(
        policy, tmp_path, "/opt/vllm/bin/python", model=Path("/m"), progress=messages.append
    )
    assert [c.name for c in children] == ["vllm short#0", "vllm long#1"]
    for child in children:
        assert isinstance(child, vstack.VllmChild)
        assert child.command[:3] == [
            "/opt/vllm/bin/python",
            "-m",
            "vllm.entrypoints.openai.api_server",
        ]
        names = child.command[child.command.index("--served-model-name") + 1 :][:2]
        assert names == list(vstack.SERVED_MODEL_NAMES)
        assert _flag(child.command, "--model") == "/m"
        assert child.env is not None and child.env[ACCEPT_ANY_MODEL_ENV] == "1"
        assert child.env["VLLM_HOST_IP"] == "127.0.0.1"
        assert child.log_path.parent == tmp_path
        assert child.health_url.endswith("/health")
    assert messages == []  # nothing capped, nothing built


def test_build_model_reuses_a_finished_build(tmp_path: Path) -> None:
    target = model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / MARKER_FILE).write_text(_marker_text(DEFAULT_SPEC))
    messages: list[str] = []
    assert vstack.build_model("/nonexistent/python", tmp_path, progress=messages.append) == target
    assert "reusing" in messages[0]


def test_build_model_failure_reports_the_output(tmp_path: Path) -> None:
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(VllmStartError, match="No module named torch"):
        vstack.build_model(str(script), tmp_path / "cache")


def _child(tmp_path: Path, name: str, code: str, health_url: str = "") -> vstack.VllmChild:
    return vstack.VllmChild(
        name=name,
        command=[sys.executable, "-c", code],
        log_path=tmp_path / f"{name}.log",
        health_url=health_url,
        stop_timeout=5,
    )


def test_a_dying_engine_is_reported_with_its_log_tail(tmp_path: Path) -> None:
    dying = _child(
        tmp_path, "vllm short#0", "print('ValueError: not enough KV cache'); raise SystemExit(1)",
        f"http://127.0.0.1:{free_port()}/health",
    )  # fmt: skip
    stack = Stack([dying])
    dying.start()
    try:
        with pytest.raises(VllmStartError, match="not enough KV cache") as info:
            vstack.wait_engines_ready(stack, timeout=30)
        assert "vllm short#0 exited (code 1)" in str(info.value)
    finally:
        stack.stop()


def test_slow_engines_show_progress_then_time_out(tmp_path: Path) -> None:
    slow = _child(
        tmp_path,
        "vllm long#1",
        "import time; print('loading weights', flush=True); time.sleep(60)",
        f"http://127.0.0.1:{free_port()}/health",
    )
    stack = Stack([slow])
    slow.start()
    messages: list[str] = []
    try:
        with pytest.raises(VllmStartError, match="not ready after"):
            vstack.wait_engines_ready(
                stack, timeout=2.0, progress=messages.append, progress_every=0.5
            )
    finally:
        stack.stop()
    assert any("loading weights" in m for m in messages)


def test_stop_and_kill_reach_the_whole_process_group(tmp_path: Path) -> None:
    # A parent that ignores SIGTERM's effect on its grandchild: the grandchild must still go.
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    for how in ("stop", "kill"):
        child = _child(tmp_path, f"vllm {how}", code)
        child.start()
        deadline = time.monotonic() + 10
        while not child.log_path.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(child.log_path.read_text().split()[0])
        if how == "stop":
            child.stop()
        else:
            child.kill()
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), how
        assert not child.alive()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_plain_children_in_the_stack_are_not_waited_for(tmp_path: Path) -> None:
    other = Child(name="envoy", command=[sys.executable, "-c", "import time; time.sleep(30)"],
                  log_path=tmp_path / "envoy.log")  # fmt: skip
    stack = Stack([other])
    other.start()
    try:
        assert vstack.wait_engines_ready(stack, timeout=1) == {}
    finally:
        stack.stop()
