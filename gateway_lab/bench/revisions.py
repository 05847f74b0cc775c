"""Another runtime package on disk, for benchmarks that measure it beside the tree they run
from: an older revision's ("before"), or the compiled build (scripts/build-compiled.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GIT_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 60.0


def tree_of_rev(rev: str, into: Path) -> Path:
    """`git archive` of the revision's extproc/ and gateway_lab/ into `into` (made if
    missing); returns it. gateway_lab comes too because extproc's CLI loads its commands
    (an entry point) when it starts: this checkout's would import modules the other
    revision's extproc may not have."""
    root = Path(__file__).resolve().parents[2]
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "extproc", "gateway_lab"],
        check=True,
        capture_output=True,
        timeout=GIT_TIMEOUT_S,
    )
    subprocess.run(
        ["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, timeout=GIT_TIMEOUT_S
    )
    return into


def tree_env(tree: Path) -> dict[str, str]:
    """The environment in which `python -m extproc ...` runs the extproc of `tree`: first on
    PYTHONPATH, and no current folder on sys.path (PYTHONSAFEPATH), since `-m` would
    otherwise put the folder the benchmark runs in, usually this checkout, ahead of it."""
    return {**os.environ, "PYTHONPATH": str(tree.resolve()), "PYTHONSAFEPATH": "1"}


def check_compiled(tree: Path) -> None:
    """Refuse to measure a compiled build at `tree` whose scheduler would run as Python."""
    probe = "import extproc.scheduler.core as m; print(m.__file__)"
    found = subprocess.run(
        [sys.executable, "-c", probe], env=tree_env(tree), capture_output=True, text=True,
        timeout=PROBE_TIMEOUT_S, check=False,
    )  # fmt: skip
    if not found.stdout.strip().endswith(".so"):
        raise SystemExit(
            f"--compiled-src {tree}: extproc.scheduler.core is not compiled there "
            f"({found.stdout.strip() or found.stderr.strip()}); run scripts/build-compiled.sh"
        )
