"""deploy/: Kubernetes manifests, the Istio EnvoyFilter and the Envoy Gateway policies agree with
the service (ports, names, probes, drain) and with extproc/envoy_config.py's rendering (processing
modes, observability mode, timeouts, limits); their Envoy snippets pass `envoy --mode validate`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.access_loggers.grpc.v3 import als_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.upstreams.http.v3 import (  # noqa: F401 (registers the type for Any)
    http_protocol_options_pb2,
)
from google.protobuf import json_format

from extproc.cli import build_parser
from extproc.envoy_config import EXTPROC_CLUSTER, RenderOptions
from extproc.envoy_lua import (
    COUNTING_FILTER,
    COUNTING_SCRIPT,
    EVENTS_CLUSTER,
    counting_script,
    counts_access_log,
)
from extproc.openai_request import INFERENCE_PATHS
from extproc.policy import Policy, parse_policy
from extproc.types import POOL_HEADER
from tests.deploy_files import (
    ADMISSION_FILTER,
    DEPLOY,
    configmap_policy,
    deploy_documents,
    ext_proc,
    find,
    port_of,
    rendered,
    rendered_filter,
    rendered_manager,
    validate_envoy,
)
from tests.mesh_bootstraps import (
    COUNTS_CLUSTER,
    SERVICE_HOST,
    envoy_gateway_bootstrap,
    envoy_gateway_operations,
    istio_bootstrap,
    istio_cluster,
    istio_patches,
)

NAMESPACE = "llm-gateway"
_MANAGER = "envoy.filters.network.http_connection_manager"
_ROUTER = "envoy.filters.http.router"


def container() -> dict[str, Any]:
    deployment = find("kubernetes", "Deployment", "extproc")
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    return main  # type: ignore[no-any-return]


def serve_args() -> Any:
    return build_parser().parse_args(container()["args"])


def env_of(main: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in main.get("env", [])}


def service_port(name: str) -> int:
    service = find("kubernetes", "Service", "extproc")
    return int(next(p for p in service["spec"]["ports"] if p["name"] == name)["port"])


def service_fqdn() -> tuple[str, int]:
    """The Service's name in the cluster and its admission (grpc) port."""
    service = find("kubernetes", "Service", "extproc")
    namespace = service["metadata"]["namespace"]
    return f"{service['metadata']['name']}.{namespace}.svc.cluster.local", service_port("grpc")


def events_port() -> int:
    """The Service's port for the counting filter's calls: the service's events listener."""
    return service_port("http-events")


def rendered_counting(policy: Policy) -> dict[str, Any]:
    """The render in the layout the mesh files use: Envoy counts (`--count-in-envoy`)."""
    fqdn, _ = service_fqdn()
    # Istio's cluster holds every replica of the Service: the admission stream is retried.
    options = RenderOptions(envoy_events=f"{fqdn}:{events_port()}", stream_retry=True)
    return rendered(policy, options)


def access_log(
    entry: dict[str, Any], *, keep_service: bool = False
) -> tuple[str, accesslog_pb2.AccessLogFilter, als_pb2.HttpGrpcAccessLogConfig]:
    """An access log's name, filter and HttpGrpcAccessLogConfig from proto JSON (either
    spelling); without its gRPC target unless asked, as `ext_proc` does."""
    typed = entry.get("typed_config") or entry["typedConfig"]
    config = json_format.ParseDict(
        {k: v for k, v in typed.items() if k != "@type"}, als_pb2.HttpGrpcAccessLogConfig()
    )
    if not keep_service:
        config.common_config.ClearField("grpc_service")
    log_filter = json_format.ParseDict(entry.get("filter", {}), accesslog_pb2.AccessLogFilter())
    return entry["name"], log_filter, config


def cluster_proto(config: dict[str, Any]) -> cluster_pb2.Cluster:
    return json_format.ParseDict(config, cluster_pb2.Cluster())


def duration_s(text: str) -> float:
    message = json_format.ParseDict({"stream_idle_timeout": text}, hcm_pb2.HttpConnectionManager())
    return float(message.stream_idle_timeout.ToTimedelta().total_seconds())


@pytest.mark.parametrize("folder", ["kubernetes", "istio", "envoy-gateway"])
def test_manifests_parse_with_kind_name_and_namespace(folder: str) -> None:
    documents = list(deploy_documents(folder))
    assert documents
    for path, doc in documents:
        assert doc.get("apiVersion") and doc.get("kind"), path
        if doc["kind"] == "Kustomization":
            continue
        assert doc["metadata"]["name"], path
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") in {NAMESPACE, "istio-system"}, path


def test_kustomization_lists_existing_files() -> None:
    kustomization = find("kubernetes", "Kustomization")
    for resource in kustomization["resources"]:
        assert (DEPLOY / "kubernetes" / resource).exists(), resource


def test_policy_configmap_is_the_shipped_policy() -> None:
    """The ConfigMap says it is policies/default.yaml: the same policy (comments aside)."""
    configmap = find("kubernetes", "ConfigMap", "extproc-policy")
    (key,) = configmap["data"]
    shipped = DEPLOY.parent / "policies" / "default.yaml"
    assert parse_policy(configmap["data"][key], key) == parse_policy(
        shipped.read_text(), str(shipped)
    )


def test_policy_configmap_is_a_valid_policy_mounted_as_a_folder() -> None:
    configmap = find("kubernetes", "ConfigMap", "extproc-policy")
    (key,) = configmap["data"]
    parse_policy(configmap["data"][key], key)  # raises with file:line on any problem
    pod = find("kubernetes", "Deployment", "extproc")["spec"]["template"]["spec"]
    volume = next(
        v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "extproc-policy"
    )
    mount = next(m for m in container()["volumeMounts"] if m["name"] == volume["name"])
    # No subPath: a subPath mount never sees ConfigMap updates, so hot reload would not work.
    assert "subPath" not in mount and mount["readOnly"]
    assert serve_args().policy == f"{mount['mountPath'].rstrip('/')}/{key}"


def test_deployment_ports_probes_and_service_agree() -> None:
    main = container()
    args = serve_args()
    assert args.command == "serve"
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports["grpc"] == port_of(args.grpc) and ports["admin"] == port_of(args.admin)
    # Envoy counts; its calls come to the events listener, on its own port.
    assert ports["http-events"] == port_of(args.envoy_events) != ports["grpc"]
    assert not args.accounting_grpc  # both would count every request twice
    for probe, path in (("livenessProbe", "/healthz"), ("startupProbe", "/healthz"),
                        ("readinessProbe", "/readyz")):  # fmt: skip
        get = main[probe]["httpGet"]
        assert get["path"] == path and get["port"] == "admin", probe
    service = find("kubernetes", "Service", "extproc")
    labels = find("kubernetes", "Deployment", "extproc")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["targetPort"] == "grpc" and by_name["grpc"]["port"] == ports["grpc"]
    assert by_name["grpc"]["appProtocol"] == "grpc"  # Istio: HTTP/2 to the service
    events = by_name["http-events"]  # Istio: HTTP/1.1, as the events listener speaks
    assert events["targetPort"] == "http-events" and events["appProtocol"] == "http"
    assert events["port"] == ports["http-events"]
    assert by_name["http-admin"]["targetPort"] == "admin"
    annotations = find("kubernetes", "Deployment", "extproc")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert int(annotations["prometheus.io/port"]) == ports["admin"]


def test_deployment_is_non_root_bounded_and_drains_within_its_grace() -> None:
    deployment = find("kubernetes", "Deployment", "extproc")
    spec = deployment["spec"]
    # With in-memory admission state both streams of a request must reach the one process.
    if configmap_policy().source.state.backend == "memory":
        assert spec["replicas"] == 1
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the Dockerfile's user
    main = container()
    security = main["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert main["resources"]["requests"]["cpu"] and main["resources"]["limits"]["memory"]
    grace = float(env_of(main)["EXTPROC_DRAIN_GRACE"])
    pre_stop = float(main["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + grace


_HEADER_MUTATION = "envoy.filters.http.header_mutation"


def header_mutation(config: dict[str, Any]) -> header_mutation_pb2.HeaderMutation:
    """A HeaderMutation proto from proto JSON (snake_case or camelCase alike)."""
    body = {k: v for k, v in config.items() if k != "@type"}
    return json_format.ParseDict(body, header_mutation_pb2.HeaderMutation())


def test_istio_envoyfilter_inserts_the_filters_and_the_access_log_like_the_render() -> None:
    policy = configmap_policy()
    bootstrap = rendered_counting(policy)
    patches = istio_patches()
    http_filters = [p for p in patches if p["applyTo"] == "HTTP_FILTER"]
    assert [p["patch"]["value"]["name"] for p in http_filters] == [
        _HEADER_MUTATION,
        ADMISSION_FILTER,
        COUNTING_FILTER,
    ]
    # The header-mutation filter as the render has it (owned headers stripped; the admission
    # stream's response headers added from its dynamic metadata).
    mutation = http_filters[0]["patch"]["value"]["typed_config"]
    assert header_mutation(mutation) == header_mutation(
        rendered_filter(bootstrap, _HEADER_MUTATION)
    )
    fqdn, grpc_port = service_fqdn()
    assert fqdn == SERVICE_HOST
    for patch in http_filters[1:]:
        assert patch["match"]["context"] == "GATEWAY"
        chain = patch["match"]["listener"]["filterChain"]["filter"]
        assert chain["name"] == _MANAGER and chain["subFilter"]["name"] == _ROUTER
        assert patch["patch"]["operation"] == "INSERT_BEFORE"
    admission = http_filters[1]["patch"]["value"]["typed_config"]
    assert ext_proc(admission) == ext_proc(rendered_filter(bootstrap, ADMISSION_FILTER))
    assert admission["grpc_service"]["envoy_grpc"]["cluster_name"] == istio_cluster(grpc_port)
    # The render's script, calling the cluster Istio makes for the Service's events port.
    counting = http_filters[2]["patch"]["value"]["typed_config"]
    expected = rendered_filter(bootstrap, COUNTING_FILTER)
    assert counting["@type"] == expected["@type"]
    assert counting["stat_prefix"] == expected["statPrefix"]
    assert counting["default_source_code"]["inline_string"] == counting_script(
        istio_cluster(events_port())
    ), "re-embed the script: python -m tests.mesh_bootstraps"
    manager = rendered_manager(bootstrap)
    merged = next(p for p in patches if p["applyTo"] == "NETWORK_FILTER")["patch"]["value"]
    typed = merged["typed_config"]
    assert duration_s(typed["stream_idle_timeout"]) == duration_s(manager["streamIdleTimeout"])
    assert duration_s(typed["request_timeout"]) == duration_s(manager["requestTimeout"])
    # The render's access log of each stream's end, to the admission port's Istio cluster.
    (log,) = typed["access_log"]
    expected_log = counts_access_log(istio_cluster(grpc_port)).to_dict()
    assert access_log(log, keep_service=True) == access_log(expected_log, keep_service=True)
    listener = next(p for p in patches if p["applyTo"] == "LISTENER")["patch"]["value"]
    expected_limit = bootstrap["staticResources"]["listeners"][0]["perConnectionBufferLimitBytes"]
    assert listener["per_connection_buffer_limit_bytes"] == expected_limit
    ports = {p["match"]["listener"]["portNumber"] for p in patches}
    assert ports == {8080}  # the ingress gateway pod's HTTP listener (Service port 80)


def test_istio_destination_rule_raises_the_extproc_circuit_breakers() -> None:
    rule = find("istio", "DestinationRule", "extproc")
    fqdn, _ = service_fqdn()
    assert rule["spec"]["host"] == fqdn
    pool = rule["spec"]["trafficPolicy"]["connectionPool"]
    rendered_cluster = rendered(configmap_policy())["staticResources"]["clusters"][0]
    limits = rendered_cluster["circuitBreakers"]["thresholds"][0]
    assert pool["http"]["http2MaxRequests"] >= limits["maxRequests"]
    assert pool["http"]["http1MaxPendingRequests"] >= limits["maxPendingRequests"]
    assert pool["tcp"]["maxConnections"] >= limits["maxConnections"]


def _pool_services() -> dict[str, int]:
    return {
        doc["metadata"]["name"]: doc["spec"]["ports"][0]["port"]
        for path, doc in deploy_documents("kubernetes")
        if doc["kind"] == "Service" and doc["metadata"]["name"].startswith("vllm-")
    }


def test_istio_routes_each_pool_header_to_its_service() -> None:
    policy = configmap_policy()
    services = _pool_services()
    routes = find("istio", "VirtualService")["spec"]["http"]
    *forwarding, not_found = routes
    matched: dict[str, str] = {}
    paths: set[str] = set()
    for route in forwarding:
        destination = route["route"][0]["destination"]
        host = destination["host"].split(".")[0]
        assert services[host] == destination["port"]["number"]
        assert route["timeout"] == "0s"
        for match in route["match"]:  # an allowlist: every forwarding route names its paths
            paths.add(match["uri"]["exact"])
            if POOL_HEADER in match.get("headers", {}):
                matched[match["headers"][POOL_HEADER]["exact"]] = host
            else:  # only GET /v1/models goes without the header the admission filter sets
                assert match == {"uri": {"exact": "/v1/models"}, "method": {"exact": "GET"}}
    assert matched == {pool: f"vllm-{pool}" for pool in policy.pools}
    assert paths == {*INFERENCE_PATHS, "/v1/models"}
    # Everything else is answered at the gateway with an OpenAI-style 404.
    assert "match" not in not_found and "route" not in not_found
    assert not_found["directResponse"]["status"] == 404
    assert json.loads(not_found["directResponse"]["body"]["string"])["error"]["code"] == "not_found"


def test_envoy_gateway_extension_policy_matches_the_render() -> None:
    policy = configmap_policy()
    bootstrap = rendered(policy)
    admission = rendered_filter(bootstrap, ADMISSION_FILTER)
    extension = find("envoy-gateway", "EnvoyExtensionPolicy")
    assert extension["spec"]["targetRefs"][0] == {
        "group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "llm-gateway",
    }  # fmt: skip
    (entry,) = extension["spec"]["extProc"]
    service = find("kubernetes", "Service", "extproc")
    _, grpc_port = service_fqdn()
    assert entry["backendRefs"] == [{"name": service["metadata"]["name"], "port": grpc_port}]
    mode = admission["processingMode"]
    assert (entry["processingMode"]["request"]["body"] == "Buffered") == (
        mode.get("requestBodyMode") == "BUFFERED"
    )
    assert entry["processingMode"]["request"]["attributes"] == admission["requestAttributes"]
    # A `response` entry would send response headers: the render skips them, and sends no
    # response body.
    assert "response" not in entry["processingMode"] and mode["responseHeaderMode"] == "SKIP"
    assert "responseBodyMode" not in mode
    assert entry["failOpen"] is bool(admission.get("failureModeAllow", False))
    # No max_message_timeout in this API: the message timeout covers the longest hold.
    assert duration_s(entry["messageTimeout"]) == duration_s(admission["maxMessageTimeout"])
    breaker = entry["backendSettings"]["circuitBreaker"]
    limits = bootstrap["staticResources"]["clusters"][0]["circuitBreakers"]["thresholds"][0]
    assert breaker["maxParallelRequests"] >= limits["maxRequests"]
    assert breaker["maxPendingRequests"] >= limits["maxPendingRequests"]


def test_envoy_gateway_patch_adds_the_counting_filter_log_and_cluster_like_the_render() -> None:
    policy = configmap_policy()
    bootstrap = rendered_counting(policy)
    patch = find("envoy-gateway", "EnvoyPatchPolicy")
    gateway = find("envoy-gateway", "Gateway", "llm-gateway")
    listener_name = gateway["spec"]["listeners"][0]["name"]
    expected_name = (
        f"{gateway['metadata']['namespace']}/{gateway['metadata']['name']}/{listener_name}"
    )
    entries = patch["spec"]["jsonPatches"]
    listener_entries = [p for p in entries if p["type"].endswith("listener.v3.Listener")]
    assert {p["name"] for p in listener_entries} == {expected_name}
    operations = envoy_gateway_operations()
    values = {p.get("path", "").rsplit("/", 1)[-1]: p for p in operations}
    idle = values["stream_idle_timeout"]["value"]
    assert duration_s(idle) == duration_s(rendered_manager(bootstrap)["streamIdleTimeout"])
    appended = [p["value"] for p in operations if p["op"] == "add"
                and p["path"].endswith("/http_filters/-")]  # fmt: skip
    assert [f["name"] for f in appended] == [COUNTING_FILTER, _ROUTER]  # router stays last
    counting = appended[0]["typed_config"]
    assert counting["default_source_code"]["inline_string"] == COUNTING_SCRIPT, (
        "re-embed the script: python -m tests.mesh_bootstraps"
    )
    assert counting["stat_prefix"] == rendered_filter(bootstrap, COUNTING_FILTER)["statPrefix"]
    removed = next(p for p in operations if p["op"] == "remove")
    assert _ROUTER in removed["jsonPath"]
    # The access log: the render's, through a cluster of its own to the admission port.
    (log,) = [p["value"] for p in operations if p.get("path", "").endswith("/access_log/-")]
    expected_log = counts_access_log(COUNTS_CLUSTER).to_dict()
    assert access_log(log, keep_service=True) == access_log(expected_log, keep_service=True)
    # The two clusters, added whole (an empty path), as the render has them for the Service's
    # name: the events cluster, and the ext_proc cluster under the access log's name.
    added = {p["operation"]["value"]["name"]: p for p in entries if p["type"].endswith("Cluster")}
    assert added.keys() == {EVENTS_CLUSTER, COUNTS_CLUSTER}
    fqdn, grpc_port = service_fqdn()
    render = rendered(
        policy, RenderOptions(extproc=f"{fqdn}:{grpc_port}", envoy_events=f"{fqdn}:{events_port()}")
    )
    for name, rendered_name in {
        EVENTS_CLUSTER: EVENTS_CLUSTER,
        COUNTS_CLUSTER: EXTPROC_CLUSTER,
    }.items():
        entry = added[name]
        assert entry["name"] == name and entry["operation"]["path"] == ""
        expected = next(
            c for c in render["staticResources"]["clusters"] if c["name"] == rendered_name
        )
        expected["name"] = expected["loadAssignment"]["clusterName"] = name
        assert cluster_proto(entry["operation"]["value"]) == cluster_proto(expected), name
    traffic = find("envoy-gateway", "ClientTrafficPolicy")
    limit = traffic["spec"]["connection"]["bufferLimit"]
    assert limit.endswith("Mi") and int(limit[:-2]) << 20 == policy.source.gateway.max_body_bytes


def test_envoy_gateway_routes_each_pool_header_to_its_service() -> None:
    policy = configmap_policy()
    services = _pool_services()
    route = find("envoy-gateway", "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "llm-gateway"}]
    matched = {}
    for rule in route["spec"]["rules"]:
        (backend,) = rule["backendRefs"]
        assert services[backend["name"]] == backend["port"]
        assert rule["timeouts"]["request"] == "0s"
        for match in rule["matches"]:
            for header in match.get("headers", []):
                assert header["name"] == POOL_HEADER
                matched[header["value"]] = backend["name"]
    assert matched == {pool: f"vllm-{pool}" for pool in policy.pools}


@pytest.mark.dataplane
@pytest.mark.parametrize("mesh", ["istio", "envoy-gateway"])
def test_deploy_filter_snippets_pass_envoy_validate(mesh: str, tmp_path: Path) -> None:
    """The Istio and Envoy Gateway pieces are valid Envoy 1.40 protos: applied to the rendered
    bootstrap as the mesh applies them (tests/mesh_bootstraps.py), Envoy checks the result.
    tests/dataplane/test_mesh_counting.py runs them."""
    bootstrap = rendered_counting(configmap_policy())
    applied = istio_bootstrap(bootstrap) if mesh == "istio" else envoy_gateway_bootstrap(bootstrap)
    result = validate_envoy(applied, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
