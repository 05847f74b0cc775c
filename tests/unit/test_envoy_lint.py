"""`extproc envoy lint`: each trap of docs/deploy.md is found at its line, the shipped configs
are clean, unreadable input exits 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.cli import main
from extproc.defaults import default_policy_path
from extproc.envoy_lint.findings import Finding
from extproc.envoy_lint.lint import lint_file
from extproc.envoy_lint.reference import reference
from extproc.policy import load_policy
from gateway_lab.processes import envoy_binary

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "envoy_lint"
REFERENCE = reference(load_policy(default_policy_path()))

# Checks the shipped configs do not pass yet (none: keep it that way).
PENDING_CHECKS: frozenset[str] = frozenset()

BOOTSTRAPS = ["envoy/envoy.json", "envoy/envoy-compose.json"]
PATCHES = [
    "deploy/istio/envoyfilter.yaml",
    "deploy/istio/gateway.yaml",
    "deploy/istio/destinationrule.yaml",
    "deploy/envoy-gateway/envoyextensionpolicy.yaml",
    "deploy/envoy-gateway/envoypatchpolicy.yaml",
    "deploy/envoy-gateway/gateway.yaml",
]

# fixture -> (the check that must fire, the file it is a copy of). Each fixture marks the line
# the finding must point at with "TRAP".
TRAPS = {
    "order_accounting_first": ("filter-order", "clean.yaml"),
    "admission_body_streamed": ("filter-order", "clean.yaml"),
    "accounting_not_observability": ("filter-order", "clean.yaml"),
    "accounting_without_role": ("filter-order", "clean.yaml"),
    "max_message_timeout_missing": ("message-timeout", "clean.yaml"),
    "max_message_timeout_short": ("message-timeout", "clean.yaml"),
    "message_timeout_default": ("message-timeout", "clean.yaml"),
    "grpc_timeout_short": ("message-timeout", "clean.yaml"),
    "stream_idle_timeout_default": ("stream-idle-timeout", "clean.yaml"),
    "stream_idle_timeout_short": ("stream-idle-timeout", "clean.yaml"),
    "route_timeout_default": ("route-timeout", "clean.yaml"),
    "cluster_default_breakers": ("extproc-cluster", "clean.yaml"),
    "cluster_http1": ("extproc-cluster", "clean.yaml"),
    "cluster_fast_keepalive": ("extproc-cluster", "clean.yaml"),
    "route_missing_pool": ("pool-routes", "clean.yaml"),
    "route_default_before_pool": ("pool-routes", "clean.yaml"),
    "route_no_default": ("pool-routes", "clean.yaml"),
    "admission_disabled": ("skipped-filter", "clean.yaml"),
    "route_skips_admission": ("skipped-filter", "clean.yaml"),
    "route_cache_retain": ("route-cache", "clean.yaml"),
    "route_cache_disabled": ("route-cache", "clean.yaml"),
    "admission_fail_open": ("failure-mode", "clean.yaml"),
    "accounting_fail_closed": ("failure-mode", "clean.yaml"),
    "body_limit_default": ("body-limit", "clean.yaml"),
    "escaped_slashes_kept": ("path-normalisation", "clean.yaml"),
    "normalize_path_off": ("path-normalisation", "clean.yaml"),
    "merge_slashes_missing": ("path-normalisation", "clean.yaml"),
    "istio_max_message_timeout_missing": ("message-timeout", "istio_accounting_layout.yaml"),
    "istio_stream_idle_timeout_short": ("stream-idle-timeout", "istio_accounting_layout.yaml"),
    "istio_accounting_after_router": ("filter-order", "istio_accounting_layout.yaml"),
    "istio_counting_before_admission": ("filter-order", "deploy/istio/envoyfilter.yaml"),
    "istio_route_timeout_set": ("route-timeout", "deploy/istio/gateway.yaml"),
    "istio_low_circuit_breakers": ("extproc-cluster", "istio_with_destinationrule.yaml"),
    "eg_message_timeout_short": (
        "message-timeout",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
    ),
    "eg_default_circuit_breakers": (
        "extproc-cluster",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
    ),
    "eg_accounting_after_router": ("filter-order", "deploy/envoy-gateway/envoypatchpolicy.yaml"),
    "eg_route_timeout_default": ("route-timeout", "deploy/envoy-gateway/gateway.yaml"),
    "eg_buffer_limit_small": ("body-limit", "deploy/envoy-gateway/gateway.yaml"),
    "eg_escaped_slashes_kept": ("path-normalisation", "deploy/envoy-gateway/gateway.yaml"),
}


def source_path(name: str) -> Path:
    return REPO / name if "/" in name else FIXTURES / name


def trap_line(path: Path) -> int:
    lines = [n for n, text in enumerate(path.read_text().splitlines(), 1) if "# TRAP" in text]
    assert len(lines) == 1, f"{path} must mark exactly one line"
    return lines[0]


def lint_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["envoy", "lint", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def notes(findings: list[Finding]) -> set[tuple[str, str]]:
    return {(f.check, f.message) for f in findings if f.severity == "note"}


@pytest.mark.parametrize("file", BOOTSTRAPS + PATCHES)
def test_shipped_configs_have_no_errors_beyond_the_pending_checks(file: str) -> None:
    findings = lint_file(str(REPO / file), REFERENCE)
    errors = [f for f in findings if f.severity == "error" and f.check not in PENDING_CHECKS]
    assert errors == []


@pytest.mark.parametrize("file", BOOTSTRAPS)
def test_shipped_bootstraps_show_every_piece(file: str) -> None:
    findings = lint_file(str(REPO / file), REFERENCE)
    assert [f for f in findings if f.check not in PENDING_CHECKS] == []


def test_the_accounting_filter_layout_of_the_istio_file_has_no_errors() -> None:
    """What docs/deploy.md offers in place of counting in Envoy lints as clean as the default."""
    findings = lint_file(str(FIXTURES / "istio_accounting_layout.yaml"), REFERENCE)
    assert [f for f in findings if f.severity == "error"] == []


def test_clean_fixture_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = lint_cli(capsys, str(FIXTURES / "clean.yaml"))
    assert (status, out) == (0, "")
    assert "0 error(s), 0 note(s)" in err


def test_a_destination_rule_next_to_the_envoy_filter_shows_the_cluster() -> None:
    name = "outbound|50051||extproc.llm-gateway.svc.cluster.local"

    def cluster_findings(path: Path) -> list[tuple[str, str]]:
        findings = lint_file(str(path), REFERENCE)
        return [(f.severity, f.message) for f in findings if f.check == "extproc-cluster"]

    # The admission filter's cluster (the counting filter's is plain HTTP, not an ext_proc's).
    assert cluster_findings(REPO / "deploy/istio/envoyfilter.yaml") == [
        ("note", f"cluster {name} is not in this file"),
    ]
    assert cluster_findings(FIXTURES / "istio_with_destinationrule.yaml") == [
        ("note", f"this file does not show whether cluster {name} speaks HTTP/2")
    ]


@pytest.mark.parametrize("name", sorted(TRAPS))
def test_each_trap_is_the_one_finding_at_its_line(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    check, source = TRAPS[name]
    path = FIXTURES / f"{name}.yaml"
    status, out, _ = lint_cli(capsys, str(path), "--format", "json")
    report: dict[str, Any] = json.loads(out)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [(f["check"], f["line"], f["file"]) for f in errors] == [
        (check, trap_line(path), str(path))
    ]
    assert (status, report["status"]) == (1, 1)
    # The notes (what a patch cannot show) are those of the file the fixture is a copy of.
    assert notes(lint_file(str(path), REFERENCE)) == notes(
        lint_file(str(source_path(source)), REFERENCE)
    )


def test_text_report_names_file_line_severity_problem_and_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = FIXTURES / "stream_idle_timeout_short.yaml"
    status, out, err = lint_cli(capsys, str(path))
    assert status == 1
    assert out == (
        f"{path}:{trap_line(path)}: error: stream_idle_timeout is 300s: a held request is an "
        "idle stream, and the policy holds up to 600s — set stream_idle_timeout: 660s "
        "(longest max_queue_wait + 60 s)\n"
    )
    assert "1 error(s), 0 note(s)" in err


def test_notes_alone_exit_zero(capsys: pytest.CaptureFixture[str]) -> None:
    path = REPO / "deploy/envoy-gateway/envoypatchpolicy.yaml"
    status, out, _ = lint_cli(capsys, str(path))
    assert status == 0
    assert out and all(": note: " in line for line in out.splitlines())


def test_a_policy_with_shorter_waits_accepts_shorter_timeouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = (
        Path(default_policy_path()).read_text().replace("max_queue_wait: 10m", "max_queue_wait: 4m")
    )
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy)
    path = FIXTURES / "stream_idle_timeout_short.yaml"
    status, out, _ = lint_cli(capsys, str(path), "--policy", str(policy_file))
    assert (status, out) == (0, "")


def test_malformed_file_exits_2_with_the_parse_error(capsys: pytest.CaptureFixture[str]) -> None:
    path = FIXTURES / "malformed.yaml"
    status, out, err = lint_cli(capsys, str(path))
    assert (status, out) == (2, "")
    assert err.startswith(f"{path}:5: cannot parse: expected ',' or '}}'")


def test_malformed_file_in_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    path = FIXTURES / "malformed.yaml"
    status, out, _ = lint_cli(capsys, str(path), "--format", "json")
    report = json.loads(out)
    assert (status, report["status"], report["findings"]) == (2, 2, [])
    assert [u.split(": cannot parse")[0] for u in report["unreadable"]] == [f"{path}:5"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: 1\ntiers: [premium]\n", "not an Envoy bootstrap (static_resources)"),
        ("", "empty file"),
    ],
)
def test_a_file_of_no_known_kind_exits_2(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    status, _, err = lint_cli(capsys, str(path))
    assert status == 2
    assert err.startswith(f"{path}: {message}")


def test_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = lint_cli(capsys, str(tmp_path / "absent.yaml"))
    assert status == 2
    assert err.startswith(f"{tmp_path / 'absent.yaml'}: cannot read")


def test_an_unusable_policy_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = lint_cli(
        capsys, str(FIXTURES / "clean.yaml"), "--policy", str(tmp_path / "absent.yaml")
    )
    assert status == 2
    assert "cannot be used" in err


@pytest.mark.dataplane
@pytest.mark.parametrize(
    "name", ["clean", *sorted(n for n, (_, source) in TRAPS.items() if source == "clean.yaml")]
)
def test_envoy_accepts_every_bootstrap_trap(name: str) -> None:
    """Each trap is a config Envoy runs without complaint: only the lint finds it."""
    config = FIXTURES / f"{name}.yaml"
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_with_cds_a_cluster_missing_from_the_file_is_a_note(tmp_path: Path) -> None:
    clean = (FIXTURES / "clean.yaml").read_text()
    without_extproc = clean.replace("    - name: extproc\n", "    - name: not_extproc\n", 1)
    static = tmp_path / "static.yaml"
    static.write_text(without_extproc)
    with_cds = tmp_path / "cds.yaml"
    with_cds.write_text(without_extproc + "dynamic_resources:\n  cds_config: {ads: {}}\n")

    def cluster_findings(path: Path) -> list[tuple[str, str]]:
        findings = lint_file(str(path), REFERENCE)
        return [(f.severity, f.message) for f in findings if f.check == "extproc-cluster"]

    assert cluster_findings(static) == [("error", "cluster extproc is not defined")]
    assert cluster_findings(with_cds) == [("note", "cluster extproc is not in this file")]
