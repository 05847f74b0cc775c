"""An older revision's runtime package on disk, for benchmarks that measure "before" beside
the tree they run from."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

GIT_TIMEOUT_S = 60.0


def tree_of_rev(rev: str, into: Path) -> Path:
    """`git archive` of the revision's extproc/ into `into` (made if missing); returns it."""
    root = Path(__file__).resolve().parents[2]
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "extproc"],
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
