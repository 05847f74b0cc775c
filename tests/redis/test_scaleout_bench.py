"""Smoke run of `extproc bench scaleout`: every arm runs, admits, and writes its outputs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from gateway_lab.bench import scaleout
from tests.redis.support import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.h2load, pytest.mark.plots, pytest.mark.smoke]


def test_scaleout_benchmark_smoke(redis_server: RedisServer, tmp_path: Path) -> None:
    del redis_server  # only to skip (or fail in CI) when there is no redis-server binary
    if shutil.which("h2load") is None:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail("h2load is missing: .ci/run installs nghttp2-client")
        pytest.skip("h2load not installed (apt-get install nghttp2-client)")
    parser = argparse.ArgumentParser()
    scaleout.add_arguments(parser)
    args = parser.parse_args(
        ["--out", str(tmp_path), "--processes", "1,2", "--duration", "1", "--warmup", "0.3",
         "--concurrency", "8"]
    )  # fmt: skip
    assert scaleout.main(args) == 0
    data = json.loads((tmp_path / "scaleout.json").read_text())
    arms = {(r["store"], r["processes"]): r for r in data["results"]}
    assert set(arms) == {("memory", 1), ("memory", 2), ("redis", 1), ("redis", 2)}
    for result in arms.values():
        assert result["admitted"] > 0 and result["errors"] == 0
        assert result["latency_p50_ms"] > 0
        assert result["service_cpu_us_per_admission"] > 0
    assert arms[("redis", 1)]["redis_cpu_us_per_admission"] > 0
    assert (tmp_path / "scaleout.png").stat().st_size > 10_000
