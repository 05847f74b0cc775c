"""`extproc bench overhead --arms / --before` (gateway_lab/bench/overhead.py): which arms run."""

from __future__ import annotations

import pytest

from gateway_lab.bench.overhead import ARMS, BEFORE_ARM, COMPILED_ARM, WORKERS_ARM, arm_names


def test_all_arms_by_default_and_the_optional_ones_only_when_asked() -> None:
    assert arm_names(False) == ARMS
    assert arm_names(True, True) == (*ARMS, COMPILED_ARM, BEFORE_ARM)


def test_chosen_arms_keep_the_floor_and_straight_in_their_order() -> None:
    assert arm_names(False, True, ["lua-before", "extproc-lua"]) == (
        "straight",
        "noop",
        "extproc-lua",
        BEFORE_ARM,
    )


def test_an_unknown_or_unavailable_arm_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown arms"):
        arm_names(False, False, ["extproc-lua", "lua-before"])  # no --before given
    with pytest.raises(SystemExit, match="unknown arms"):
        arm_names(False, False, ["nonsense"])


def test_the_two_worker_arm_runs_only_when_named() -> None:
    assert WORKERS_ARM not in arm_names(True, True)
    assert arm_names(False, False, ["extproc-lua", WORKERS_ARM]) == (
        "straight",
        "noop",
        "extproc-lua",
        WORKERS_ARM,
    )
