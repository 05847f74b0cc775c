"""What a benchmark ran on, saved beside its figures: the code's revision, the interpreter,
the host and every installed package's version.

The same benchmark gave the default policy's `over` tail 2x on one day and 6x on the next with
the same service code (docs/benchmarks.md, "An objective relative to alone"); the virtualenv
had been rebuilt in between and nothing recorded what it held. With this record in each
`results.json`, `extproc bench provenance A B` says what differs between two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from gateway_lab.processes import envoy_binary

KEY = "provenance"
"""The key a results.json keeps the record under."""
COMMAND_TIMEOUT_S = 10.0


def provenance() -> dict[str, Any]:
    """The record of this process's environment (JSON-ready)."""
    return {
        "revision": _revision(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores_allowed": len(os.sched_getaffinity(0)),
        "envoy": _envoy_version(),
        "packages": installed_packages(),
    }


def with_provenance(report: Any) -> Any:
    """`report` with the record added under KEY, if it is a mapping without one."""
    if isinstance(report, Mapping) and KEY not in report:
        return {**report, KEY: provenance()}
    return report


def installed_packages() -> dict[str, str]:
    """Every distribution this interpreter sees: normalized name -> version."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower().replace("_", "-")] = dist.version
    return dict(sorted(found.items()))


def differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What differs between two records, one line each (packages by name); [] if nothing."""
    lines: list[str] = []
    for field in ("revision", "python", "platform", "cpu", "cores_allowed", "envoy"):
        if before.get(field) != after.get(field):
            lines.append(f"{field}: {before.get(field)} -> {after.get(field)}")
    old: Mapping[str, str] = before.get("packages", {})
    new: Mapping[str, str] = after.get("packages", {})
    for name in sorted(old.keys() | new.keys()):
        if old.get(name) != new.get(name):
            lines.append(f"{name}: {old.get(name, '(absent)')} -> {new.get(name, '(absent)')}")
    return lines


def _run(command: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _revision() -> dict[str, Any] | None:
    """The checkout's commit and whether its tracked files differ from it; None outside git."""
    root = Path(__file__).resolve().parents[2]
    commit = _run(["git", "rev-parse", "HEAD"], root)
    if commit is None:
        return None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit, "dirty": bool(status)}


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return None


def _envoy_version() -> str | None:
    try:
        binary = envoy_binary()
    except RuntimeError:
        return None
    return _run([binary, "--version"])


def _record_of(path: Path) -> Mapping[str, Any]:
    data = json.loads(path.read_text())
    record = data.get(KEY) if isinstance(data, dict) else None
    if not isinstance(record, dict):
        raise SystemExit(f"{path}: no {KEY!r} record (saved before benchmarks kept one)")
    return record


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("before", type=Path, help="a benchmark's results.json")
    parser.add_argument("after", type=Path, help="another one")


def main(args: argparse.Namespace) -> int:
    lines = differences(_record_of(args.before), _record_of(args.after))
    print("\n".join(lines) if lines else "the same revision, host and packages")
    return 0
