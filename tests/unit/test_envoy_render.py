"""The rendered bootstrap passes the real Envoy's validation (the `dataplane` tests), and envoy/
stays in sync."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from extproc.envoy_config import RenderOptions, render_bootstrap
from extproc.policy import load_policy, policy_from_text
from gateway_lab.processes import envoy_binary
from tests.conftest import policy_yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_OPTIONS = RenderOptions(
    listen="0.0.0.0:8080",
    extproc="extproc:50051",
    pool_endpoints={"short": ["engine-short:8000"], "long": ["engine-long:8000"]},
)


def validate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.dataplane
def test_render_passes_envoy_validate(tmp_path: Path) -> None:
    config = tmp_path / "envoy.json"
    config.write_text(render_bootstrap(policy_from_text(policy_yaml()), RenderOptions()))
    result = validate(config)
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_holds_requests_long_enough() -> None:
    policy = policy_from_text(policy_yaml(acme_limits="{max_queue_wait: 2m}"))
    bootstrap = json.loads(render_bootstrap(policy, RenderOptions()))
    manager = bootstrap["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0][
        "typedConfig"
    ]
    admission, accounting, router = manager["httpFilters"]
    assert admission["typedConfig"]["maxMessageTimeout"] == "150s"
    assert accounting["typedConfig"]["observabilityMode"] is True
    assert router["name"] == "envoy.filters.http.router"
    assert manager["streamIdleTimeout"] == "180s"
    extproc = bootstrap["staticResources"]["clusters"][0]
    assert extproc["circuitBreakers"]["thresholds"][0]["maxRequests"] >= 100_000


@pytest.mark.dataplane
def test_invalid_bootstrap_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "broken.json"
    config.write_text(json.dumps({"static_resources": {"clusters": [{"name": 1}]}}))
    assert validate(config).returncode != 0


@pytest.mark.dataplane
@pytest.mark.parametrize(
    ("file", "options"), [("envoy.json", RenderOptions()), ("envoy-compose.json", COMPOSE_OPTIONS)]
)
def test_committed_configs_match_render_and_validate(file: str, options: RenderOptions) -> None:
    committed = REPO / "envoy" / file
    fresh = render_bootstrap(load_policy(REPO / "policies" / "default.yaml"), options)
    assert committed.read_text() == fresh, f"re-render envoy/{file} (see envoy/README.md)"
    assert validate(committed).returncode == 0


def test_no_init_py_in_envoy_folder() -> None:
    assert not (REPO / "envoy" / "__init__.py").exists()
