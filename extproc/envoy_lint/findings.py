"""One finding: where, how bad, what is wrong and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "note"]
"""error: the setting breaks admission under load. note: the file cannot show it; check where
it is set."""


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    severity: Severity
    check: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.severity}: {self.message} — {self.fix}"


@dataclass(frozen=True)
class Issue:
    """A finding before it knows its file: what the checks return."""

    line: int
    severity: Severity
    message: str
    fix: str


def error(line: int, message: str, fix: str) -> Issue:
    return Issue(line, "error", message, fix)


def note(line: int, message: str, fix: str) -> Issue:
    return Issue(line, "note", message, fix)


def missing(complete: bool, line: int, message: str, fix: str) -> Issue:
    """An absent piece: an error in a whole bootstrap, a note in a patch that cannot show it."""
    return Issue(line, "error" if complete else "note", message, fix)
