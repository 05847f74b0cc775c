"""The lint's reading of files: lines through YAML merges, both spellings of a field, and the
ways Envoy, Istio and Kubernetes write durations and sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from extproc.envoy_lint.source import Node, load_documents
from extproc.envoy_lint.values import byte_count, seconds


def test_lines_survive_yaml_merges_and_both_spellings(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "shared: &grpc\n"
        "  timeout: 630s\n"
        "filter:\n"
        "  <<: *grpc\n"
        "  maxMessageTimeout: 630s\n"
        "---\n"
        "second: {message_timeout: 5s}\n"
    )
    first, second = load_documents(str(path))
    merged = first.at("filter", "timeout")
    camel = first.at("filter", "max_message_timeout")
    assert merged is not None and (merged.value, merged.line) == ("630s", 2)
    assert camel is not None and (camel.value, camel.line) == ("630s", 5)
    flow = second.at("second", "message_timeout")
    assert flow is not None and (flow.value, flow.line) == ("5s", 7)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("630s", 630.0),
        ("0.25s", 0.25),
        ("10m30s", 630.0),
        ("500ms", 0.5),
        ("1h", 3600.0),
        (630, 630.0),
        ("0s", 0.0),
        ("soon", None),
        ("5", None),
        (True, None),
    ],
)
def test_durations(value: Any, expected: float | None) -> None:
    assert seconds(Node(value, 1)) == expected


def test_duration_as_seconds_and_nanos(tmp_path: Path) -> None:
    path = tmp_path / "d.yaml"
    path.write_text("d: {seconds: 630, nanos: 500000000}\n")
    [document] = load_documents(str(path))
    node = document.get("d")
    assert node is not None and seconds(node) == 630.5


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (8388608, 8388608),
        ("8388608", 8388608),
        ("8Mi", 8 << 20),
        ("32Ki", 32 << 10),
        ("8M", 8_000_000),
        ("big", None),
    ],
)
def test_byte_counts(value: Any, expected: int | None) -> None:
    assert byte_count(Node(value, 1)) == expected
