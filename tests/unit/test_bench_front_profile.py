"""The front profile's reading of `perf report`: samples by shared object, per chunk."""

from __future__ import annotations

import pytest

from gateway_lab.bench import front_profile

REPORT = """\
# Samples: 1K of event 'cpu-clock:ppp'
#
# Overhead       Samples  Shared Object
# ........  ............  ..........................................
#
    43.50%           539  libpython3.11.so.1.0
    23.49%           291  cygrpc.cpython-311-x86_64-linux-gnu.so
    17.84%           221  [kernel.kallsyms]
     3.87%            48  _message.abi3.so
     0.32%             4  /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30

# (for the call graph, use -g)
"""


def test_the_report_gives_exact_samples_per_object() -> None:
    samples = front_profile.parse_dso_report(REPORT)
    assert samples == {
        "libpython3.11.so.1.0": 539,
        "cygrpc.cpython-311-x86_64-linux-gnu.so": 291,
        "[kernel.kallsyms]": 221,
        "_message.abi3.so": 48,
        "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30": 4,
    }


@pytest.mark.parametrize(
    ("dso", "name"),
    [
        ("libpython3.11.so.1.0", "libpython3.11"),
        ("cygrpc.cpython-311-x86_64-linux-gnu.so", "cygrpc"),
        ("[kernel.kallsyms]", "kernel"),
        ("_message.abi3.so", "_message"),
        ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30", "libstdc++"),
    ],
)
def test_objects_get_short_names(dso: str, name: str) -> None:
    assert front_profile.short_name(dso) == name


def test_samples_become_microseconds_per_chunk() -> None:
    # 999 samples a second: 999 samples are one second of CPU; over 20,000 chunks, 50 us each
    assert front_profile.per_chunk_us({"x": 999}, 20_000) == {"x": pytest.approx(50.0)}
    assert front_profile.per_chunk_us({"x": 10}, 0) == {}


def test_rounds_of_an_arm_merge_into_one() -> None:
    rounds = [
        {"arm": "a", "samples": {"x": 999, "y": 10}, "sampled_s": 12.0, "chunks_sampled": 10_000,
         "cpu_us_per_request": 30_000.0, "chunks_per_request": 503.0},
        {"arm": "a", "samples": {"x": 999}, "sampled_s": 12.0, "chunks_sampled": 30_000,
         "cpu_us_per_request": 34_000.0, "chunks_per_request": 503.0},
    ]  # fmt: skip
    merged = front_profile.merge(rounds)
    assert merged["rounds"] == 2 and merged["samples"] == {"x": 1998, "y": 10}
    assert merged["chunks_sampled"] == 40_000
    assert merged["us_per_chunk"]["x"] == pytest.approx(50.0)  # 2 s of CPU over 40,000 chunks
    assert merged["cpu_us_per_request"] == pytest.approx(32_000.0)
