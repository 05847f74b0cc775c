"""The embedded default policy, shipped as package data.

`policies/default.yaml` in the repository is the same file for people and containers to edit;
a test keeps the two identical.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def default_policy_path() -> str:
    """Path of the embedded default policy, wherever the package is installed."""
    return str(Path(str(files(__name__) / "default.yaml")))
