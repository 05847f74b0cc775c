"""The vLLM helpers' pure parts and process handling, without vLLM (fast; runs everywhere)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway_lab.vllm_cpu.launcher import (
    LONG_POOL,
    SHORT_POOL,
    VllmStartError,
    free_port,
    log_tail,
    preset_command,
    stop_process_group,
    vllm_command,
    vllm_env,
    wait_ready,
)
from gateway_lab.vllm_cpu.model_builder import (
    SPECIAL_TOKENS,
    _split_pattern,
    is_built,
    model_dir,
    special_token_table,
    vocab_and_merges,
)
from tests.conftest import health_endpoint


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_command_uses_module_entry_point_on_loopback() -> None:
    command = vllm_command(
        "/m", 8123, 2048, 32, served_model_name="x", kv_cache_blocks=64, python="py"
    )
    assert command[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(command, "--host") == "127.0.0.1"
    assert _flag(command, "--port") == "8123"
    assert _flag(command, "--max-model-len") == "2048"
    assert _flag(command, "--max-num-seqs") == "32"
    assert _flag(command, "--served-model-name") == "x"
    assert _flag(command, "--num-gpu-blocks-override") == "64"
    assert "--enforce-eager" not in command


def test_presets_shape_the_two_pools() -> None:
    assert SHORT_POOL.max_num_seqs > LONG_POOL.max_num_seqs
    assert SHORT_POOL.max_model_len < LONG_POOL.max_model_len >= 8192
    assert SHORT_POOL.cpu_bind != LONG_POOL.cpu_bind
    for preset in (SHORT_POOL, LONG_POOL):
        assert preset.kv_cache_blocks is None or (preset.kv_cache_blocks - 1) * 128 >= (
            preset.max_model_len
        )


def test_env_is_offline_private_and_pinned() -> None:
    env = vllm_env("1", 2, base={"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_NO_USAGE_STATS"] == env["DO_NOT_TRACK"] == "1"


def test_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("\n".join(str(i) for i in range(100)))
    assert log_tail(log, 3) == "97\n98\n99"
    assert "cannot read" in log_tail(tmp_path / "missing.log")
    assert log_tail(None) == "(no log file)"


def _spawn(code: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def test_wait_ready_raises_with_log_tail_when_process_dies(tmp_path: Path) -> None:
    log = tmp_path / "dead.log"
    proc = _spawn("import sys; print('engine exploded'); sys.exit(3)", log)
    try:
        with pytest.raises(VllmStartError, match="engine exploded") as info:
            wait_ready(f"http://127.0.0.1:{free_port()}", proc, 20, log_path=log)
        assert "code 3" in str(info.value)
    finally:
        stop_process_group(proc)


def test_wait_ready_times_out_and_stop_kills_the_group(tmp_path: Path) -> None:
    log = tmp_path / "slow.log"
    proc = _spawn("import time; print('loading', flush=True); time.sleep(60)", log)
    try:
        with pytest.raises(VllmStartError, match="not ready after"):
            wait_ready(
                f"http://127.0.0.1:{free_port()}", proc, 1.0, log_path=log, poll_interval=0.1
            )
    finally:
        stop_process_group(proc, timeout=5)
    assert proc.returncode is not None


@pytest.fixture
def health_url() -> Iterator[str]:
    with health_endpoint("/health") as url:
        yield url


def test_wait_ready_returns_once_healthy(tmp_path: Path, health_url: str) -> None:
    proc = _spawn("import time; time.sleep(30)", tmp_path / "ok.log")
    try:
        assert wait_ready(health_url, proc, 10) < 5
    finally:
        stop_process_group(proc, timeout=5)


# ----------------------------------------------------------------------------- tokenizer parts


def test_vocab_and_merges_follow_rank_order() -> None:
    ranks = {b"a": 0, b"b": 1, b" ": 2, b"ab": 3, b" a": 4, b" ab": 5}
    vocab, merges = vocab_and_merges(ranks)
    assert vocab["ab"] == 3
    assert vocab["Ġa"] == 4  # byte-level: space is shown as "Ġ"
    assert merges == [("a", "b"), ("Ġ", "a"), ("Ġ", "ab"), ("Ġa", "b")]


def test_special_token_table_is_contiguous() -> None:
    table = special_token_table(100256, SPECIAL_TOKENS)
    ids = sorted(table.values())
    assert ids == list(range(100256, 100277))
    assert table["<|endoftext|>"] == 100257
    assert table["<|im_end|>"] == 100265
    assert table["<|reserved_100256|>"] == 100256


def test_split_pattern_is_oniguruma_safe() -> None:
    pattern = _split_pattern(r"\p{N}{1,3}+|\s++$|[^\r\n\p{L}\p{N}]?+\p{L}++")
    assert pattern == r"\p{N}{1,3}|\s+\z|[^\r\n\p{L}\p{N}]?\p{L}+"


def test_is_built_needs_the_marker(tmp_path: Path) -> None:
    target = model_dir(tmp_path)
    assert not is_built(target)
    target.mkdir(parents=True)
    (target / ".extproc-model").write_text("stale")
    assert not is_built(target)


REPO = Path(__file__).resolve().parents[2]


def _vllm_argvs() -> dict[str, list[str]]:
    """argv of every vLLM server the project ships: compose gpu pools, Kubernetes, presets."""
    from ruamel.yaml import YAML

    yaml = YAML(typ="safe")
    argvs: dict[str, list[str]] = {}
    compose = yaml.load((REPO / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        if "vllm.entrypoints.openai.api_server" in service.get("entrypoint", []):
            argvs[f"compose {name}"] = [str(arg) for arg in service["command"]]
    for doc in yaml.load_all((REPO / "deploy/kubernetes/vllm-pools.yaml").read_text()):
        if not doc or doc.get("kind") != "Deployment":
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if "vllm.entrypoints.openai.api_server" in container.get("command", []):
                argvs[f"kubernetes {doc['metadata']['name']}"] = list(container["args"])
    for preset in (SHORT_POOL, LONG_POOL):
        argvs[f"preset {preset.name}"] = preset_command("/m", 8000, preset, python="py")
    return argvs


def test_every_shipped_vllm_pool_runs_priority_scheduling() -> None:
    argvs = _vllm_argvs()
    assert {"compose vllm-short", "compose vllm-long", "preset short", "preset long"} <= set(argvs)
    assert sum(name.startswith("kubernetes ") for name in argvs) == 2
    for name, argv in argvs.items():
        joined = " ".join(argv)
        assert "--scheduling-policy=priority" in argv or "--scheduling-policy priority" in joined, (
            name
        )


def test_preset_threshold_becomes_the_vllm_flag() -> None:
    from dataclasses import replace

    capped = replace(SHORT_POOL, long_prefill_token_threshold=256)
    assert _flag(
        preset_command("/m", 1, capped, python="py"), "--long-prefill-token-threshold"
    ) == ("256")
    off = replace(SHORT_POOL, long_prefill_token_threshold=0)
    assert "--long-prefill-token-threshold" not in preset_command("/m", 1, off, python="py")


def test_short_pool_caps_prefill_chunks_and_long_pool_does_not() -> None:
    short = preset_command("/m", 1, SHORT_POOL, python="py")
    assert _flag(short, "--long-prefill-token-threshold") == "256"
    assert "--long-prefill-token-threshold" not in preset_command("/m", 1, LONG_POOL, python="py")
