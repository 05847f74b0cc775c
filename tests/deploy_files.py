"""Helpers of the static checks: YAML documents, compose interpolation, Envoy configs as protos."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from google.protobuf import json_format
from ruamel.yaml import YAML

from extproc.envoy_config import ACCOUNTING_FILTER, ADMISSION_FILTER, RenderOptions, build_bootstrap
from extproc.policy import Policy, policy_from_text
from gateway_lab.processes import envoy_binary
from tests.serve_support import REPO

DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"
ENVOY_COMPOSE = REPO / "envoy" / "envoy-compose.json"
PROMETHEUS_FILE = REPO / "monitoring" / "prometheus.yml"
DASHBOARDS = REPO / "monitoring" / "grafana" / "dashboards"
PROVISIONING = REPO / "monitoring" / "grafana" / "provisioning"


def load_yaml(path: Path) -> Any:
    return YAML(typ="safe").load(path.read_text())


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in YAML(typ="safe").load_all(path.read_text()) if doc]


def deploy_documents(folder: str) -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted((DEPLOY / folder).glob("*.yaml")):
        for doc in load_documents(path):
            yield path, doc


def find(folder: str, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        doc
        for _, doc in deploy_documents(folder)
        if doc.get("kind") == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/{folder}, got {len(found)}"
    return found[0]


_VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} with no environment: every variable takes its default."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def flag_value(command: list[str], flag: str) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE` in an argument list."""
    for index, arg in enumerate(command):
        if arg == flag and index + 1 < len(command):
            return command[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def validate_envoy(
    config: dict[str, Any] | Path, workdir: Path, extra: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    if isinstance(config, dict):
        path = workdir / "bootstrap.json"
        path.write_text(json.dumps(config))
    else:
        path = config
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), *(extra or [])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def configmap_policy() -> Policy:
    configmap = find("kubernetes", "ConfigMap", "extproc-policy")
    (key,) = configmap["data"]
    return policy_from_text(configmap["data"][key], f"configmap:{key}")


def rendered(policy: Policy, options: RenderOptions | None = None) -> dict[str, Any]:
    """The bootstrap `extproc envoy render` produces for `policy` (proto JSON, camelCase)."""
    data: dict[str, Any] = build_bootstrap(policy, options or RenderOptions()).to_dict()
    return data


def rendered_manager(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["staticResources"]["listeners"][0]
    manager: dict[str, Any] = listener["filterChains"][0]["filters"][0]["typedConfig"]
    return manager


def rendered_filter(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    filters = rendered_manager(bootstrap)["httpFilters"]
    config: dict[str, Any] = next(f for f in filters if f["name"] == name)["typedConfig"]
    return config


def ext_proc(
    config: dict[str, Any], *, keep_service: bool = False
) -> ext_proc_pb2.ExternalProcessor:
    """An ExternalProcessor proto from proto JSON (snake_case or camelCase alike); without its
    grpc_service target unless asked, since each deployment names the service its own way."""
    message = json_format.ParseDict(
        {k: v for k, v in config.items() if k != "@type"}, ext_proc_pb2.ExternalProcessor()
    )
    if not keep_service:
        message.grpc_service.ClearField("envoy_grpc")
        message.grpc_service.ClearField("google_grpc")
    return message


# The retry policy's host predicate, in an Any: its type must be known to parse the filter.
assert previous_hosts_pb2.PreviousHostsPredicate

__all__ = [
    "ACCOUNTING_FILTER",
    "ADMISSION_FILTER",
    "COMPOSE_FILE",
    "DASHBOARDS",
    "DEPLOY",
    "ENVOY_COMPOSE",
    "PROMETHEUS_FILE",
    "PROVISIONING",
    "configmap_policy",
    "deploy_documents",
    "ext_proc",
    "find",
    "flag_value",
    "interpolate",
    "load_documents",
    "load_yaml",
    "port_of",
    "rendered",
    "rendered_filter",
    "rendered_manager",
    "validate_envoy",
]
