"""The layering in ARCHITECTURE.md, checked: the contracts live in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint)], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_default_policy_is_the_shipped_file() -> None:
    from extproc.defaults import default_policy_path

    packaged = Path(default_policy_path())
    assert packaged.is_file()
    assert packaged.read_bytes() == (REPO / "policies" / "default.yaml").read_bytes()
