"""The real-vLLM pooling preset, without vLLM: a pool serving only pooling classes gets vLLM's
pooling runner with the model converted to an embedding model."""

from __future__ import annotations

from extproc.policy import policy_from_text
from gateway_lab.vllm_cpu import stack as vstack
from gateway_lab.vllm_cpu.launcher import POOL_PRESETS, POOLING_POOL, preset_command
from tests.pooling_support import EMBED_POOL, chat_and_pooling_policy_yaml, pooling_policy_yaml


def test_the_pooling_preset_runs_vllms_pooling_runner() -> None:
    command = preset_command("/m", 8000, POOLING_POOL, python="py")
    at = command.index("--runner")
    assert command[at : at + 4] == ["--runner", "pooling", "--convert", "embed"]
    assert POOL_PRESETS["pooling"] is POOLING_POOL
    short = preset_command("/m", 8000, POOL_PRESETS["short"], python="py")
    assert "--runner" not in short and "--convert" not in short


def test_a_pool_serving_only_pooling_classes_gets_the_pooling_preset() -> None:
    policy = policy_from_text(chat_and_pooling_policy_yaml("127.0.0.1:1", "127.0.0.1:2"))
    specs = {spec.pool: spec for spec in vstack.engine_specs(policy, cores=[0, 1])}
    assert specs[EMBED_POOL].preset.runner == "pooling"
    assert specs[EMBED_POOL].preset.convert == "embed"
    # A whole input goes into one step: the step budget holds the longest input.
    assert specs[EMBED_POOL].preset.max_num_batched_tokens >= specs[EMBED_POOL].preset.max_model_len
    assert specs["short"].preset.runner is None
    # The smallest generative pool keeps the short shape whatever the pooling pool's size.
    assert specs["short"].preset.max_num_seqs == POOL_PRESETS["short"].max_num_seqs


def test_three_pools_keep_short_and_long_for_the_generative_ones() -> None:
    policy = policy_from_text(pooling_policy_yaml())
    specs = {spec.pool: spec.preset for spec in vstack.engine_specs(policy, cores=[0])}
    assert (
        specs["short"].long_prefill_token_threshold
        == POOL_PRESETS["short"].long_prefill_token_threshold
    )
    assert specs["long"].max_num_seqs == POOL_PRESETS["long"].max_num_seqs
    assert specs[EMBED_POOL].runner == "pooling"
    assert specs[EMBED_POOL].max_num_batched_tokens == 8192  # its max_total_tokens
