"""`revisions.tree_of_rev`: a revision's extproc/ on disk, for the "before" arms."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gateway_lab.bench.revisions import tree_of_rev


def test_a_revision_is_unpacked_with_its_package(tmp_path: Path) -> None:
    tree = tree_of_rev("HEAD", tmp_path / "before")
    assert tree == tmp_path / "before"
    assert (tree / "extproc" / "__init__.py").is_file()
    assert not (tree / "gateway_lab").exists()  # only the runtime package


def test_an_unknown_revision_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        tree_of_rev("no-such-revision-anywhere", tmp_path / "x")
