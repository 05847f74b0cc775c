"""A benchmark's results.json says what it ran on, and two of them can be compared."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from gateway_lab.bench import scenario
from gateway_lab.bench.provenance import KEY, differences, provenance, with_provenance

CLI_TIMEOUT_S = 60.0


def test_the_record_names_the_revision_and_the_installed_versions() -> None:
    record = provenance()
    assert record["packages"]["grpcio"] == metadata.version("grpcio")
    assert record["python"] == sys.version.split()[0]
    revision = record["revision"]
    if revision is not None:  # a checkout (CI clones one); None only outside git
        assert len(revision["commit"]) == 40 and isinstance(revision["dirty"], bool)
    assert record["envoy"] is None or "envoy" in record["envoy"].lower()


def test_saved_results_carry_the_record_and_keep_their_own_fields(tmp_path: Path) -> None:
    scenario.save_results(tmp_path, {"arms": {"a": 1}}, "x.png", lambda _p: None, lambda: None)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["arms"] == {"a": 1}
    assert saved[KEY]["packages"]["orjson"] == metadata.version("orjson")
    assert with_provenance([1, 2]) == [1, 2]  # only a mapping can carry it
    already = {KEY: {"python": "3.0"}}
    assert with_provenance(already) is already


def test_differences_name_each_changed_field_and_package() -> None:
    before = {"revision": {"commit": "a"}, "python": "3.11.2", "envoy": "1.40",
              "packages": {"grpcio": "1.66.0", "orjson": "3.10.0", "gone": "1"}}  # fmt: skip
    after = {"revision": {"commit": "a"}, "python": "3.11.2", "envoy": "1.41",
             "packages": {"grpcio": "1.67.1", "orjson": "3.10.0", "new": "2"}}  # fmt: skip
    assert differences(before, after) == [
        "envoy: 1.40 -> 1.41",
        "gone: 1 -> (absent)",
        "grpcio: 1.66.0 -> 1.67.1",
        "new: (absent) -> 2",
    ]
    assert differences(before, before) == []


def test_the_command_compares_two_saved_runs(tmp_path: Path) -> None:
    record = provenance()
    older = {**record, "packages": {**record["packages"], "grpcio": "0.0.1"}}
    (tmp_path / "a.json").write_text(json.dumps({KEY: older}))
    (tmp_path / "b.json").write_text(json.dumps({KEY: record}))
    (tmp_path / "old.json").write_text(json.dumps({"arms": {}}))
    extproc = [sys.executable, "-m", "extproc.cli", "bench", "provenance"]
    done = subprocess.run(
        [*extproc, str(tmp_path / "a.json"), str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == f"grpcio: 0.0.1 -> {record['packages']['grpcio']}"
    refused = subprocess.run(
        [*extproc, str(tmp_path / "old.json"), str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
    )  # fmt: skip
    assert refused.returncode != 0 and "no 'provenance' record" in refused.stderr
