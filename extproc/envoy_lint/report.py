"""Print findings as `FILE:LINE: severity: what is wrong — the fix`, or as JSON for CI."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TextIO

from extproc.envoy_lint.findings import Finding

CLEAN, ERRORS, UNREADABLE = 0, 1, 2


def exit_status(findings: list[Finding], unreadable: list[str]) -> int:
    if unreadable:
        return UNREADABLE
    return ERRORS if any(f.severity == "error" for f in findings) else CLEAN


def write_text(findings: list[Finding], unreadable: list[str], out: TextIO, err: TextIO) -> None:
    for problem in unreadable:
        print(problem, file=err)
    for finding in findings:
        print(finding, file=out)
    if unreadable and not findings:
        return
    errors = sum(f.severity == "error" for f in findings)
    notes = len(findings) - errors
    print(f"{errors} error(s), {notes} note(s)", file=err)


def write_json(findings: list[Finding], unreadable: list[str], out: TextIO) -> None:
    document = {
        "status": exit_status(findings, unreadable),
        "unreadable": unreadable,
        "findings": [asdict(f) for f in findings],
    }
    out.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
