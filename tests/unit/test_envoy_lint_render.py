"""The lint and `extproc envoy render` agree: the lint's reference values are the render's,
and whatever the render writes passes the lint (but for the checks the render is gaining)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from extproc.envoy_config import RenderOptions, render_bootstrap
from extproc.envoy_lint.lint import lint_file
from extproc.envoy_lint.reference import reference
from extproc.envoy_lint.source import Node
from extproc.envoy_lint.values import seconds
from extproc.envoy_lua import COUNTING_FILTER
from extproc.envoy_routes import ACCOUNTING_FILTER, ADMISSION_FILTER
from extproc.policy import Policy, policy_from_text
from tests.conftest import policy_yaml
from tests.serve_support import REPO
from tests.unit.test_envoy_lint import PENDING_CHECKS

POLICIES = {
    "test policy": policy_yaml(),
    "2 min wait": policy_yaml(acme_limits="{max_queue_wait: 2m}"),
    "2 h wait (capped)": policy_yaml(acme_limits="{max_queue_wait: 2h}"),
    "small bodies": policy_yaml(extra="gateway: {max_body_bytes: 65536, message_timeout: 2s}"),
}


def duration(text: str) -> float:
    value = seconds(Node(text, 1))
    assert value is not None
    return value


def rendered(policy: Policy, tmp_path: Path) -> tuple[Path, str]:
    text = render_bootstrap(policy, RenderOptions())
    path = tmp_path / "envoy.json"
    path.write_text(text)
    return path, text


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_reference_values_are_the_renders(name: str, tmp_path: Path) -> None:
    policy = policy_from_text(POLICIES[name])
    _, text = rendered(policy, tmp_path)
    listener = json.loads(text)["staticResources"]["listeners"][0]
    manager = listener["filterChains"][0]["filters"][0]["typedConfig"]
    (admission,) = (
        f["typedConfig"] for f in manager["httpFilters"] if f["name"] == ADMISSION_FILTER
    )
    ref = reference(policy)
    assert ref.hold == duration(admission["maxMessageTimeout"])
    assert ref.hold == duration(admission["grpcService"]["timeout"])
    assert ref.message_timeout == duration(admission["messageTimeout"])
    assert ref.idle == duration(manager["streamIdleTimeout"])
    assert ref.max_body_bytes == listener["perConnectionBufferLimitBytes"]
    assert ref.pools == tuple(policy.pools)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_render_passes_the_lint(name: str, tmp_path: Path) -> None:
    policy = policy_from_text(POLICIES[name])
    path, _ = rendered(policy, tmp_path)
    findings = lint_file(str(path), reference(policy))
    assert [f for f in findings if f.check not in PENDING_CHECKS] == []


def test_a_render_for_longer_waits_fails_the_lint_of_the_shorter_one(tmp_path: Path) -> None:
    short = policy_from_text(policy_yaml(acme_limits="{max_queue_wait: 2m}"))
    long = policy_from_text(policy_yaml(acme_limits="{max_queue_wait: 20m}"))
    path, _ = rendered(short, tmp_path)
    findings = lint_file(str(path), reference(long))
    failed = {(f.check, f.severity) for f in findings if f.check not in PENDING_CHECKS}
    assert failed == {("message-timeout", "error"), ("stream-idle-timeout", "error")}


def test_camel_case_json_points_at_the_broken_line(tmp_path: Path) -> None:
    policy = policy_from_text(policy_yaml())
    path, text = rendered(policy, tmp_path)
    lines = text.splitlines()
    number = next(i for i, line in enumerate(lines, 1) if '"maxMessageTimeout"' in line)
    lines[number - 1] = re.sub(r'"[^"]*s"', '"1s"', lines[number - 1])
    path.write_text("\n".join(lines) + "\n")
    findings = lint_file(str(path), reference(policy))
    errors = [f for f in findings if f.check not in PENDING_CHECKS]
    assert [(f.check, f.line, f.severity) for f in errors] == [("message-timeout", number, "error")]


def test_counting_in_envoy_passes_the_lint_and_both_counters_do_not(tmp_path: Path) -> None:
    """`--count-in-envoy` renders Envoy's counting filter in place of the accounting ext_proc
    filter: the lint takes it for the accounting role; a config with both (each settling every
    request) or with the counting filter before the admission filter is an error."""
    policy = policy_from_text(policy_yaml())
    text = render_bootstrap(policy, RenderOptions(envoy_events="127.0.0.1:50060"))
    path = tmp_path / "envoy.json"
    path.write_text(text)
    ok = lint_file(str(path), reference(policy))
    assert [f for f in ok if f.check not in PENDING_CHECKS] == []

    config = json.loads(text)
    manager = config["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0]
    filters = manager["typedConfig"]["httpFilters"]
    names = [f["name"] for f in filters]
    assert COUNTING_FILTER in names and ACCOUNTING_FILTER not in names
    counting = filters.pop(names.index(COUNTING_FILTER))
    with_accounting = json.loads(render_bootstrap(policy, RenderOptions()))
    manager_b = with_accounting["staticResources"]["listeners"][0]["filterChains"][0]["filters"]
    filters_b = manager_b[0]["typedConfig"]["httpFilters"]
    filters_b.insert(len(filters_b) - 1, counting)
    both = tmp_path / "both.json"
    both.write_text(json.dumps(with_accounting, indent=2))
    errors = [f for f in lint_file(str(both), reference(policy)) if f.severity == "error"]
    assert any("counted twice" in f.message for f in errors), errors

    filters.insert(0, counting)  # before the admission filter
    early = tmp_path / "early.json"
    early.write_text(json.dumps(config, indent=2))
    errors = [f for f in lint_file(str(early), reference(policy)) if f.severity == "error"]
    assert any("comes before" in f.message for f in errors), errors


def test_counting_without_an_unbuffered_grpc_access_log_fails_the_lint(tmp_path: Path) -> None:
    """The end of each counted response comes on the gRPC access log: without it, or with
    Envoy's buffering, capacity comes back late or never."""
    policy = policy_from_text(policy_yaml())
    config = json.loads(render_bootstrap(policy, RenderOptions(envoy_events="127.0.0.1:50060")))
    manager = config["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0]
    logs = manager["typedConfig"]["accessLog"]
    grpc_log = next(log for log in logs if log["name"] == "envoy.access_loggers.http_grpc")
    common = grpc_log["typedConfig"]["commonConfig"]

    def counting_log_findings(name: str) -> list[tuple[str, str, str]]:
        path = tmp_path / name
        path.write_text(json.dumps(config, indent=2))
        found = lint_file(str(path), reference(policy))
        lines = path.read_text().splitlines()
        return [
            (f.severity, lines[f.line - 1].strip(), f.message)
            for f in found
            if f.check == "counting-log"
        ]

    assert counting_log_findings("rendered.json") == []
    common["bufferSizeBytes"] = 16384
    ((severity, line, message),) = counting_log_findings("buffered.json")
    assert (severity, line) == ("error", '"bufferSizeBytes": 16384')
    assert "16384 bytes" in message
    del common["bufferSizeBytes"]  # Envoy's default buffers too
    ((severity, _, message),) = counting_log_findings("default.json")
    assert severity == "error" and "16 KiB by default" in message
    logs.remove(grpc_log)
    ((severity, line, message),) = counting_log_findings("no-log.json")
    assert (severity, line) == ("error", f'"name": "{COUNTING_FILTER}",')
    assert "holds its capacity" in message


def test_an_istio_merge_without_access_logs_leaves_the_counting_log_to_a_note(
    tmp_path: Path,
) -> None:
    text = (REPO / "deploy/istio/envoyfilter.yaml").read_text()
    start = text.index("            access_log:\n")
    end = text.index("    # The admission filter buffers", start)
    path = tmp_path / "envoyfilter.yaml"
    path.write_text(text[:start] + text[end:])
    policy = policy_from_text(policy_yaml())
    findings = [f for f in lint_file(str(path), reference(policy)) if f.check == "counting-log"]
    assert [f.severity for f in findings] == ["note"]
    shipped = lint_file(str(REPO / "deploy/istio/envoyfilter.yaml"), reference(policy))
    assert [f for f in shipped if f.check == "counting-log"] == []


def test_both_ways_of_taking_the_body_pass_and_a_streamed_body_that_waits_does_not(
    tmp_path: Path,
) -> None:
    """One round trip (STREAMED, sent without waiting: the render) and two (BUFFERED) are
    fine; STREAMED with Envoy waiting for the headers reply is an error: the request would go
    upstream on that reply, before the service saw the body."""
    policy = policy_from_text(policy_yaml())

    def admission_findings(one_round_trip: bool, edit: dict[str, object]) -> list[str]:
        config = json.loads(render_bootstrap(policy, RenderOptions(one_round_trip=one_round_trip)))
        manager = config["staticResources"]["listeners"][0]["filterChains"][0]["filters"][0]
        (admission,) = (
            f["typedConfig"]
            for f in manager["typedConfig"]["httpFilters"]
            if f["name"] == ADMISSION_FILTER
        )
        admission.update(edit)
        path = tmp_path / "envoy.json"
        path.write_text(json.dumps(config, indent=2))
        findings = lint_file(str(path), reference(policy))
        return [f.message for f in findings if f.check not in PENDING_CHECKS]

    assert admission_findings(True, {}) == []
    assert admission_findings(False, {}) == []
    (message,) = admission_findings(True, {"sendBodyWithoutWaitingForHeaderResponse": False})
    assert "request_body_mode is STREAMED" in message
    assert "send_body_without_waiting_for_header_response" in message
