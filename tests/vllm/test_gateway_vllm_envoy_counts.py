"""Counting in Envoy (`extproc up`'s and docker-compose's default layout) in front of real vLLM
(CPU): Envoy's Lua filter counts vLLM's streams and the service settles them from Envoy's access
log. The same checks as tests/vllm/test_gateway_vllm.py's counting tests, on a stack of its own
(a module of its own, so that its engines start after the other module's have stopped)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import policy_yaml
from tests.vllm.test_gateway_vllm import (
    abandoned_streams_are_corrected_to_vllm_counters,
    counted_tokens_equal_vllm_usage,
    vllm_gateway_or_skip,
)

pytestmark = [pytest.mark.vllm, pytest.mark.dataplane]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    workdir = tmp_path_factory.mktemp("gateway-vllm-envoy-counts")
    with vllm_gateway_or_skip(workdir, policy_yaml, count_in_envoy=True) as running:
        assert running.config.envoy_events is not None
        yield running


async def test_counted_tokens_equal_vllm_usage_when_envoy_counts(gateway: Any) -> None:
    await counted_tokens_equal_vllm_usage(gateway)


async def test_abandoned_streams_are_corrected_to_vllm_counters_when_envoy_counts(
    gateway: Any,
) -> None:
    await abandoned_streams_are_corrected_to_vllm_counters(gateway)
