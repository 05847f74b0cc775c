"""`revisions.tree_of_rev`: a revision's extproc/ on disk, for the "before" arms; `tree_env`:
the environment that runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway_lab.bench.revisions import check_compiled, tree_env, tree_of_rev

REPO = Path(__file__).resolve().parents[2]


def test_a_revision_is_unpacked_with_its_package(tmp_path: Path) -> None:
    tree = tree_of_rev("HEAD", tmp_path / "before")
    assert tree == tmp_path / "before"
    assert (tree / "extproc" / "__init__.py").is_file()
    assert (tree / "gateway_lab" / "cli.py").is_file()  # the commands its CLI loads
    assert not (tree / "tests").exists()


def test_the_other_trees_cli_loads_its_own_commands(tmp_path: Path) -> None:
    """`extproc serve` of the other tree starts its CLI, which loads gateway_lab's commands:
    the other tree's, not this checkout's (which may import modules it lacks)."""
    tree = tree_of_rev("HEAD", tmp_path / "before")
    probe = "import extproc.cli, gateway_lab.cli; print(gateway_lab.cli.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=tree_env(tree),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(tree.resolve())


def test_an_unknown_revision_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        tree_of_rev("no-such-revision-anywhere", tmp_path / "x")


def test_python_m_from_the_checkout_runs_the_other_tree(tmp_path: Path) -> None:
    """`python -m` puts the current folder first on sys.path; the benchmarks run from the
    checkout, whose own extproc/ would then be the one that runs."""
    package = tmp_path / "extproc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "where_from.py").write_text("import extproc\nprint(extproc.__file__)\n")
    done = subprocess.run(
        [sys.executable, "-m", "extproc.where_from"], cwd=REPO, env=tree_env(tmp_path),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(package / "__init__.py")


def test_a_folder_without_a_compiled_build_is_refused(tmp_path: Path) -> None:
    """Rather than measuring the source as if it were the compiled build."""
    with pytest.raises(SystemExit, match="is not compiled there"):
        check_compiled(tmp_path)
