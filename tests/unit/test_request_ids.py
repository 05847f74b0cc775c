"""Request ids name the worker that admitted them, for Envoy's counting script to route on."""

from __future__ import annotations

import re

from extproc.service.processor import request_id_prefix

# The script's pattern (extproc.envoy_lua, WORKER_IN_ID) in Python's syntax.
WORKER_IN_ID = re.compile(r"w(\d+)-\d+$")


def test_a_workers_ids_end_with_its_index_before_the_count() -> None:
    prefix = request_id_prefix("3")
    assert prefix.endswith("w3")
    found = WORKER_IN_ID.search(f"{prefix}-17")
    assert found is not None and found.group(1) == "3"
    assert re.fullmatch(r"[0-9a-f]+-[0-9a-f]+-[0-9a-f]{6}w3", prefix)  # pid, time, random


def test_a_lone_process_has_no_worker_in_its_ids() -> None:
    for index in ("", " ", "x", "²", "-1"):
        prefix = request_id_prefix(index)
        assert "w" not in prefix, index
        assert WORKER_IN_ID.search(f"{prefix}-17") is None
