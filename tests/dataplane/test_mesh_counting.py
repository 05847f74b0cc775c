"""The mesh files count: the Istio EnvoyFilter's and the Envoy Gateway patch's counting filter,
access log and clusters, applied to the real Envoy as each mesh applies them
(tests/mesh_bootstraps.py), in front of the real service and emulated engines, pass the
counting checks every layout passes (tests/dataplane/test_accounting.py): tenants' counts equal
the engines' usage, abandoned streams are corrected from the engines' counters, each response's
first token and later output reach the service through the mesh's events cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway_lab.up import StackConfig
from tests.conftest import policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway
from tests.dataplane.test_accounting import (
    LIMITS,
    test_counted_tokens_equal_engine_usage,
    test_every_short_response_in_a_burst_gives_a_first_token,
    test_first_tokens_and_gaps_reach_the_service,
    test_requests_refused_at_admission_send_no_access_log_entry,
)
from tests.mesh_bootstraps import envoy_gateway_bootstrap, istio_bootstrap

pytestmark = pytest.mark.dataplane

__all__ = [
    "test_counted_tokens_equal_engine_usage",
    "test_every_short_response_in_a_burst_gives_a_first_token",
    "test_first_tokens_and_gaps_reach_the_service",
    "test_requests_refused_at_admission_send_no_access_log_entry",
]


def applied(mesh: str) -> Callable[[dict[str, Any], StackConfig], dict[str, Any]]:
    def apply(bootstrap: dict[str, Any], config: StackConfig) -> dict[str, Any]:
        if mesh == "istio":
            return istio_bootstrap(bootstrap)
        return envoy_gateway_bootstrap(bootstrap, grpc=config.grpc, events=config.envoy_events)

    return apply


@pytest.fixture(scope="module", params=["istio", "envoy-gateway"])
def gateway(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[RunningGateway]:
    def make(short: str, long_: str) -> str:
        return policy_yaml(short, long_, acme_limits=LIMITS, globex_limits=LIMITS, short_inflight=8)

    workdir = tmp_path_factory.mktemp(f"mesh-{request.param}")
    with running_gateway(
        workdir, make, count_in_envoy=True, envoy_bootstrap=applied(request.param)
    ) as running:
        yield running
