"""docker-compose.yml, the Dockerfile and the Prometheus config, checked statically (no Docker
engine here): the files parse, every mounted host file exists, the mounted Envoy config passes
`envoy --mode validate`, and names and ports agree across compose, Envoy and Prometheus.

Profiles are resolved as `docker compose config` does (Debian's docker-compose is v1, which
cannot read this Compose Spec file): with no --profile flag, COMPOSE_PROFILES from .env; a
--profile flag replaces that list. Where a Compose v2 client exists, its answer is compared."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from setuptools import find_packages

from extproc.cli import build_parser
from extproc.policy import load_policy
from tests.deploy_files import (
    COMPOSE_FILE,
    ENVOY_COMPOSE,
    PROMETHEUS_FILE,
    flag_value,
    interpolate,
    load_yaml,
    port_of,
    validate_envoy,
)
from tests.serve_support import REPO

# What `docker compose [--profile P] ...` is given: () is plain `docker compose up`.
SELECTIONS = {"default": (), "gpu": ("gpu",), "cpu": ("cpu",)}
MONITORING = {"prometheus", "grafana"}
EMULATED = {"engine-short", "engine-long"}
VLLM = {"vllm-short", "vllm-long"}


def dotenv() -> dict[str, str]:
    """The project folder's .env as compose reads it (KEY=VALUE lines, # comments)."""
    values = {}
    for line in (REPO / ".env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip().strip("'\"")
    return values


def profiles_of(selection: str) -> set[str]:
    """The active profiles: the --profile flags, else COMPOSE_PROFILES from .env."""
    flags = SELECTIONS[selection]
    if flags:
        return set(flags)
    return {p.strip() for p in dotenv().get("COMPOSE_PROFILES", "").split(",") if p.strip()}


def enabled(selection: str) -> set[str]:
    return {
        name
        for name, service in compose()["services"].items()
        if active(service, profiles_of(selection))
    }


def compose() -> dict[str, Any]:
    data: dict[str, Any] = interpolate(load_yaml(COMPOSE_FILE))
    return data


def envoy_config() -> dict[str, Any]:
    config: dict[str, Any] = json.loads(ENVOY_COMPOSE.read_text())
    return config


def envoy_overrides() -> list[str]:
    """The `envoy` service's extra arguments after `-c FILE` (e.g. --config-yaml)."""
    command = command_of(compose()["services"]["envoy"])
    return command[command.index("-c") + 2 :]


def envoy_admin() -> tuple[str, int]:
    """Envoy's admin address as the container runs it: the file's, unless --config-yaml
    overrides it."""
    address = envoy_config()["admin"]["address"]["socketAddress"]
    host, port = address["address"], address["portValue"]
    override = flag_value(command_of(compose()["services"]["envoy"]), "--config-yaml")
    if override:
        socket = json.loads(override).get("admin", {}).get("address", {}).get("socket_address")
        if socket:
            host, port = socket.get("address", host), socket.get("port_value", port)
    return host, int(port)


def active(service: dict[str, Any], profiles: set[str]) -> bool:
    own = service.get("profiles")
    return not own or bool(profiles & set(own))


def names_of(name: str, service: dict[str, Any]) -> set[str]:
    """The DNS names a service answers to on the default network: its own and its aliases."""
    names = {name}
    networks = service.get("networks") or {}
    if isinstance(networks, dict):
        for network in networks.values():
            names.update((network or {}).get("aliases", []))
    return names


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def listen_ports(name: str, service: dict[str, Any]) -> set[int]:
    """Ports the service's process listens on, read from its command line."""
    command = command_of(service)
    ports = set()
    for flag in ("--grpc", "--accounting-grpc", "--envoy-events", "--admin"):
        value = flag_value(command, flag)
        if value:
            ports.add(port_of(value))
    port = flag_value(command, "--port")
    if port:
        ports.add(int(port))
    if name == "envoy":
        config = envoy_config()
        ports.add(envoy_admin()[1])
        for listener in config["staticResources"]["listeners"]:
            ports.add(listener["address"]["socketAddress"]["portValue"])
    if name == "prometheus":
        ports.add(9090)
    if name == "grafana":
        ports.add(3000)
    return ports


def resolve(host: str, port: int, selection: str) -> list[str]:
    """Services enabled by `selection` that answer to host:port."""
    services = compose()["services"]
    return [
        name
        for name in sorted(enabled(selection))
        if host in names_of(name, services[name]) and port in listen_ports(name, services[name])
    ]


def envoy_endpoints() -> list[tuple[str, str, int]]:
    out = []
    for cluster in envoy_config()["staticResources"]["clusters"]:
        for group in cluster["loadAssignment"]["endpoints"]:
            for lb in group["lbEndpoints"]:
                address = lb["endpoint"]["address"]["socketAddress"]
                out.append((cluster["name"], address["address"], address["portValue"]))
    return out


def prometheus_targets() -> list[tuple[str, str, str]]:
    out = []
    for job in load_yaml(PROMETHEUS_FILE)["scrape_configs"]:
        for group in job.get("static_configs", []):
            for target in group["targets"]:
                host, _, port = target.rpartition(":")
                out.append((job["job_name"], host, port))
    return out


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume.get("source", ""), volume["target"]
        mounts.append((source, target))
    return mounts


def test_compose_parses_with_the_expected_services() -> None:
    services = compose()["services"]
    assert {"envoy", "extproc", "vllm-short", "vllm-long", "engine-short", "engine-long",
            "prometheus", "grafana"} <= set(services)  # fmt: skip
    assert services["envoy"]["image"].startswith("envoyproxy/envoy:v1.40")
    for name in ("vllm-short", "vllm-long"):
        assert services[name]["profiles"] == ["gpu"]
        assert services[name]["image"].startswith("vllm/vllm-openai:")
    for name in ("engine-short", "engine-long"):
        assert services[name]["profiles"] == ["cpu"]
        assert command_of(services[name])[0] == "engine"


def test_plain_up_runs_emulated_engines_and_the_gpu_profile_runs_vllm() -> None:
    core = {"envoy", "extproc"} | MONITORING
    assert enabled("default") == core | EMULATED
    assert enabled("gpu") == core | VLLM  # the flag replaces .env's list: no emulated engines
    assert enabled("cpu") == enabled("default")


@pytest.mark.parametrize("selection", SELECTIONS)
def test_dependencies_exist_and_required_ones_are_enabled(selection: str) -> None:
    services = compose()["services"]
    running = enabled(selection)
    for name in sorted(running):
        depends = services[name].get("depends_on") or {}
        targets = depends if isinstance(depends, dict) else {key: {} for key in depends}
        for target, condition in targets.items():
            assert target in services, f"{name} depends on undefined service {target}"
            required = (condition or {}).get("required", True)
            if required:
                assert target in running, f"{selection}: {name} needs {target}, not enabled"
            wanted = (condition or {}).get("condition")
            # extproc's healthcheck is its image's HEALTHCHECK (the Dockerfile test).
            if wanted == "service_healthy" and target in running and target != "extproc":
                assert "healthcheck" in services[target], (
                    f"{name} waits for {target} to be healthy but it has no healthcheck"
                )


def test_envoy_mounts_the_config_its_command_loads() -> None:
    envoy = compose()["services"]["envoy"]
    config = command_of(envoy)[command_of(envoy).index("-c") + 1]
    mounts = dict((target, source) for source, target in bind_mounts(envoy))
    assert config in mounts, f"envoy loads {config}, which is not mounted"
    assert REPO / mounts[config] == ENVOY_COMPOSE


def _compose_v2() -> list[str] | None:
    """`docker compose` (v2) if this machine has it; Debian's v1 cannot read this file."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        found = subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [docker, "compose"] if found.returncode == 0 else None


@pytest.mark.parametrize("selection", SELECTIONS)
def test_docker_compose_config_agrees_where_compose_v2_exists(selection: str) -> None:
    client = _compose_v2()
    if client is None:
        pytest.skip("no Docker Compose v2 client here: the static checks above stand in for it")
    flags = [arg for profile in SELECTIONS[selection] for arg in ("--profile", profile)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    result = subprocess.run(
        [*client, "--project-directory", str(REPO), *flags, "config", "--services"],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == enabled(selection)


def test_every_mount_exists_and_named_volumes_are_declared() -> None:
    data = compose()
    declared = set(data.get("volumes") or {})
    for name, service in data["services"].items():
        for source, target in bind_mounts(service):
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name}: {source} -> {target} does not exist"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared"


@pytest.mark.dataplane
def test_mounted_envoy_config_passes_envoy_validate(tmp_path: Path) -> None:
    (source, target) = next(
        m for m in bind_mounts(compose()["services"]["envoy"]) if m[1].endswith(".json")
    )
    assert REPO / source == ENVOY_COMPOSE
    assert target in command_of(compose()["services"]["envoy"])
    result = validate_envoy(ENVOY_COMPOSE, tmp_path, envoy_overrides())
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("selection", SELECTIONS)
def test_every_envoy_cluster_endpoint_is_a_compose_service(selection: str) -> None:
    for cluster, host, port in envoy_endpoints():
        answering = resolve(host, port, selection)
        assert len(answering) == 1, (
            f"{selection}: cluster {cluster} -> {host}:{port} is served by {answering}"
        )
    # The listener is what the compose file publishes.
    listener = envoy_config()["staticResources"]["listeners"][0]["address"]["socketAddress"]
    published = [str(p).rpartition(":")[2] for p in compose()["services"]["envoy"]["ports"]]
    assert str(listener["portValue"]) in published
    assert listener["address"] == "0.0.0.0"


@pytest.mark.parametrize("selection", SELECTIONS)
def test_every_prometheus_target_is_a_compose_service(selection: str) -> None:
    jobs = set()
    for job, host, port in prometheus_targets():
        answering = resolve(host, int(port), selection)
        assert len(answering) == 1, f"{selection}: {job} {host}:{port} -> {answering}"
        jobs.add(job)
    assert jobs == {"extproc", "envoy", "engines"}


def test_envoy_admin_is_reachable_by_prometheus_but_not_published() -> None:
    host, port = envoy_admin()
    assert host not in {"127.0.0.1", "::1", "localhost"}, "Prometheus runs in another container"
    assert ("envoy", "envoy", str(port)) in prometheus_targets()
    published = {str(p).rpartition(":")[2] for p in compose()["services"]["envoy"]["ports"]}
    assert str(port) not in published, "Envoy's admin must not be published to the host"


def test_extproc_service_runs_serve_with_a_watched_policy_folder() -> None:
    service = compose()["services"]["extproc"]
    command = command_of(service)
    args = build_parser().parse_args(command)  # the image's ENTRYPOINT is `extproc`
    assert args.command == "serve"
    assert port_of(args.grpc) == 50051 and args.grpc.startswith("0.0.0.0:")
    assert args.admin.startswith("0.0.0.0:")  # inside the container only: not published
    assert "ports" not in service
    (source, target) = next(m for m in bind_mounts(service) if "polic" in m[1])
    assert (REPO / source).is_dir(), "mount the policy folder, not the file (editors rename)"
    assert args.policy.startswith(target.rstrip("/") + "/")
    host_policy = REPO / source / args.policy[len(target.rstrip("/")) + 1 :]
    load_policy(host_policy)
    grace = float(service["environment"]["EXTPROC_DRAIN_GRACE"])
    stop = float(str(service["stop_grace_period"]).rstrip("s"))
    assert stop > grace


def test_cpu_engines_parse_as_extproc_engine_commands() -> None:
    services = compose()["services"]
    for name in ("engine-short", "engine-long"):
        args = build_parser().parse_args(command_of(services[name]))
        assert args.command == "engine" and args.port == 8000 and args.accept_any_model
        assert services[name]["image"] == services["extproc"]["image"]


def test_vllm_pools_reserve_gpus_and_fit_the_policy_pools() -> None:
    services = compose()["services"]
    raw = load_yaml(COMPOSE_FILE)  # before interpolation: the knobs are variables
    policy = load_policy(REPO / "policies" / "default.yaml")
    for pool in ("short", "long"):
        service = services[f"vllm-{pool}"]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        command = command_of(service)
        assert flag_value(command, "--port") == "8000"
        max_len = int(flag_value(command, "--max-model-len") or 0)
        # A request routed to the pool must fit the engine's context.
        assert max_len >= policy.pools[pool].max_total_tokens
        raw_command = " ".join(raw["services"][f"vllm-{pool}"]["command"])
        prefix = pool.upper()
        assert f"${{{prefix}_MODEL:-" in raw_command
        assert f"${{{prefix}_MAX_MODEL_LEN:-" in raw_command
    assert flag_value(command_of(services["vllm-short"]), "--max-model-len") == "8192"
    assert flag_value(command_of(services["vllm-long"]), "--max-model-len") == "131072"


def test_grafana_mounts_provisioning_and_dashboards() -> None:
    grafana = dict(bind_mounts(compose()["services"]["grafana"]))
    assert grafana["./monitoring/grafana/provisioning"] == "/etc/grafana/provisioning"
    providers = load_yaml(REPO / "monitoring/grafana/provisioning/dashboards/llm-gateway.yml")[
        "providers"
    ]
    assert grafana["./monitoring/grafana/dashboards"] == providers[0]["options"]["path"]
    datasource = load_yaml(REPO / "monitoring/grafana/provisioning/datasources/prometheus.yml")[
        "datasources"
    ][0]
    host, _, port = datasource["url"].removeprefix("http://").partition(":")
    assert resolve(host, int(port), "default") == ["prometheus"]


def _dockerfile() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def test_dockerfile_is_slim_non_root_with_a_healthcheck() -> None:
    steps = _dockerfile()
    assert steps[0] == ("FROM", "python:3.11-slim")
    users = [rest for op, rest in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert any(op == "RUN" and re.search(r"pip install (\S+ )*\.(\s|$)", rest)
               for op, rest in steps)  # fmt: skip
    health = next(rest for op, rest in steps if op == "HEALTHCHECK")
    assert "/healthz" in health
    entrypoint = json.loads(next(rest for op, rest in steps if op == "ENTRYPOINT"))
    cmd = json.loads(next(rest for op, rest in steps if op == "CMD"))
    assert entrypoint == ["extproc"]
    args = build_parser().parse_args(cmd)
    assert f":{port_of(args.admin)}/healthz" in health
    ignore = (REPO / ".dockerignore").read_text().split()
    for needed in ("!pyproject.toml", "!README.md", "!extproc/", "!gateway_lab/", "!policies/"):
        assert needed in ignore
    uid = users[-1].split(":")[0]
    assert f"--uid {uid}" in " ".join(rest for op, rest in steps if op == "RUN")


def _build_context(into: Path) -> Path:
    """The folder the Dockerfile's `pip install .` runs in: the files .dockerignore lets into
    the context (its `!` lines; caches out), copied by the COPY steps before that RUN."""
    text = (REPO / ".dockerignore").read_text().splitlines()
    lines = [line.strip() for line in text if line.strip() and not line.startswith("#")]
    assert lines[0] == "**", "the context is an allowlist: ** first, then ! entries"
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    workdir = Path("/")
    for op, rest in _dockerfile():
        if op == "WORKDIR":
            workdir = Path(rest)
        elif op == "COPY":
            *sources, dest = rest.split()
            target = into / (workdir / dest).relative_to("/")
            for source in sources:
                assert source in allowed, f"COPY {source}: .dockerignore keeps it out"
                origin = REPO / source
                if origin.is_dir():
                    shutil.copytree(
                        origin, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                    )  # fmt: skip
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, target / origin.name)
        elif op == "RUN" and re.search(r"pip install (\S+ )*\.(\s|$)", rest):
            return into / workdir.relative_to("/")
    raise AssertionError("no `pip install .` in the Dockerfile")


def test_the_image_installs_both_packages_with_the_lab_commands(tmp_path: Path) -> None:
    """The image runs `extproc serve` and, in compose, `extproc engine` (gateway_lab): its
    `pip install .` must see every package setuptools finds in the checkout, their package
    data and the modules the entry points name."""
    context = _build_context(tmp_path / "root")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools_config = project["tool"]["setuptools"]
    include = setuptools_config["packages"]["find"]["include"]
    in_checkout = set(find_packages(str(REPO), include=include))
    assert {"extproc", "gateway_lab", "gateway_lab.engine"} <= in_checkout
    assert set(find_packages(str(context), include=include)) == in_checkout
    for package in in_checkout:
        folder = package.replace(".", "/")
        modules = {p.name for p in (REPO / folder).glob("*.py")}
        copied = {p.name for p in (context / folder).glob("*.py")}
        assert modules == copied, f"{package}: missing from the image: {modules - copied}"
    for package, patterns in setuptools_config["package-data"].items():
        for pattern in patterns:
            assert list((context / package).glob(pattern)), f"{package}/{pattern} not copied"
    entry_points = [project["project"]["scripts"]["extproc"]]
    for group in project["project"]["entry-points"].values():
        entry_points.extend(group.values())
    assert "gateway_lab.cli:register" in entry_points
    for entry_point in entry_points:
        module = entry_point.partition(":")[0].replace(".", "/")
        assert (context / f"{module}.py").is_file(), f"{entry_point}: not in the image"
