"""Profiles (lookup, overrides, calibration) and the token counting rule."""

from __future__ import annotations

import argparse

import pytest

from gateway_lab.engine import cli
from gateway_lab.engine.model import EngineCore
from gateway_lab.engine.profiles import PROFILES, get_profile
from gateway_lab.engine.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    PromptError,
    chat_prompt_tokens,
    completion_prompt_tokens,
    output_piece,
    output_text,
    text_tokens,
)


def test_named_profiles_exist() -> None:
    assert {"a100-llama3-8b", "cpu-tiny", "fast"} <= set(PROFILES)
    assert get_profile("fast").step_base_s <= 0.001


def test_unknown_profile_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown engine profile 'h100'.*a100-llama3-8b"):
        get_profile("h100")


def test_overrides_replace_fields_and_validate() -> None:
    profile = get_profile("fast", max_num_seqs=3, kv_blocks=None)
    assert profile.max_num_seqs == 3 and profile.kv_blocks == PROFILES["fast"].kv_blocks
    with pytest.raises(ValueError, match="unknown engine profile field"):
        get_profile("fast", warp_speed=9)
    with pytest.raises(ValueError, match="cannot hold one request"):
        get_profile("fast", kv_blocks=2)
    with pytest.raises(ValueError):
        get_profile("fast", max_num_seqs=0)


def test_a100_short_request_ttft_is_about_50ms() -> None:
    profile = get_profile("a100-llama3-8b")
    core = EngineCore(profile)
    core.add_request("q", prompt_tokens=200, max_tokens=10)
    first = core.step(0.0)
    ttft = profile.frontend_s + first.duration
    assert 0.040 <= ttft <= 0.055
    decode = core.step(first.end)
    assert 0.010 <= decode.duration <= 0.015  # single-stream ITL


def test_cli_overrides_reach_the_profile() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--port", "0", "--profile", "fast", "--max-num-seqs", "7", "--step-base-s", "0.002"]
    )
    server = cli.build_server(args)
    assert server.profile.max_num_seqs == 7 and server.profile.step_base_s == 0.002
    assert server.profile.kv_blocks == PROFILES["fast"].kv_blocks


def test_text_rule_is_ceil_bytes_over_four() -> None:
    assert text_tokens("") == 0
    assert text_tokens("abcd") == 1
    assert text_tokens("abcde") == 2
    assert text_tokens("é" * 4) == 2  # 8 UTF-8 bytes


def test_chat_counts_content_plus_overhead() -> None:
    messages = [
        {"role": "system", "content": "x" * 8},
        {"role": "user", "content": [{"type": "text", "text": "y" * 5}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
    ]
    assert chat_prompt_tokens(messages) == 3 * MESSAGE_OVERHEAD_TOKENS + 2 + 2
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat_prompt_tokens(messages, tools) > chat_prompt_tokens(messages)
    with pytest.raises(PromptError):
        chat_prompt_tokens([])
    with pytest.raises(PromptError):
        chat_prompt_tokens([{"role": "user", "content": 5}])


def test_completion_prompt_forms() -> None:
    assert completion_prompt_tokens("a" * 9) == 3
    assert completion_prompt_tokens([1, 2, 3]) == 3
    assert completion_prompt_tokens(["abcd"]) == 1
    with pytest.raises(PromptError):
        completion_prompt_tokens(["a", "b"])
    with pytest.raises(PromptError):
        completion_prompt_tokens(None)


def test_output_is_deterministic_and_counts_back_to_itself() -> None:
    assert output_text(3) == output_piece(0) + output_piece(1) + output_piece(2)
    assert output_text(3) == output_text(3)
    for n in (1, 7, 100):
        assert text_tokens(output_text(n)) == n
