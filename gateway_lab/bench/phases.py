"""Where a request's time goes at low load: Envoy's own timestamps per phase, from its access
log (timing operators, microseconds from the first byte Envoy received), per arm.

Phases (each the time since Envoy received the request's first byte, DS_RX_BEG):

* `request_in`: the whole request received (DS_RX_END);
* `upstream_start`: the first byte sent to the engine (US_TX_BEG): after the ext_proc request
  headers and body round trips, if any;
* `upstream_headers`: the engine's response headers (US_RX_BEG);
* `upstream_first_chunk`: the engine's first body byte (US_RX_BODY_BEG);
* `client_headers`: the response headers sent to the client (DS_TX_BEG): after the ext_proc
  response-headers round trip, if any.

Differences between consecutive phases are what each step costs; the arms (straight, the
do-nothing ext_proc, ours) side by side show which steps the ext_proc adds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway_lab.bench.records import percentile

TIMING_FIELDS = {
    "request_in": "%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%",
    "upstream_start": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "upstream_headers": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",
    "upstream_first_chunk": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",
    "client_headers": "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:us)%",
}
PHASES = tuple(TIMING_FIELDS)
START_FIELD = "start_s"
START_FORMAT = "%START_TIME(%s.%6f)%"
"""The request's start, epoch seconds with microseconds: joins a line with the client's record
of the same request (gateway_lab.bench.quiet_path)."""
EXT_PROC_FIELDS = {
    f"ext_proc_{name}": f"%FILTER_STATE(extproc.admission:FIELD:{name})%"
    for name in (
        "request_header_latency_us",
        "request_body_total_latency_us",
        "response_header_latency_us",
    )
}
"""How long Envoy waited for each ext_proc reply of the admission filter (its logging info)."""
EXT_PROC_STEPS = {
    "ext_proc_request_header_latency_us": "  of which: Envoy waits for the request-headers reply",
    "ext_proc_request_body_total_latency_us": "  of which: Envoy waits for the request-body reply",
    "ext_proc_response_header_latency_us": "  Envoy waits for the response-headers reply",
}
STEPS = (
    ("receive request", None, "request_in"),
    ("request -> upstream (ext_proc headers + body)", "request_in", "upstream_start"),
    ("upstream -> response headers (engine)", "upstream_start", "upstream_headers"),
    ("response headers -> client (ext_proc response headers)", "upstream_headers",
     "client_headers"),
    ("response headers -> first chunk (engine)", "upstream_headers", "upstream_first_chunk"),
)  # fmt: skip
MARK = "phase_log"


def _access_logs(node: Any) -> Iterable[dict[str, Any]]:
    if isinstance(node, dict):
        yield from node.get("accessLog", ())
        for value in node.values():
            yield from _access_logs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _access_logs(value)


def timed_bootstrap(text: str) -> str:
    """The rendered bootstrap with the timing fields added to its access log(s)."""
    bootstrap = json.loads(text)
    found = 0
    for entry in _access_logs(bootstrap):
        if "logFormat" not in entry["typedConfig"]:
            continue  # the gRPC access log of counting in Envoy (extproc.envoy_lua)
        fields = entry["typedConfig"]["logFormat"]["jsonFormat"]
        fields.update(TIMING_FIELDS)
        fields.update(EXT_PROC_FIELDS)
        fields[MARK] = "1"
        fields["tenant_header"] = "%REQ(X-BENCH-TENANT)%"
        fields[START_FIELD] = START_FORMAT
        fields["details"] = "%RESPONSE_CODE_DETAILS%"
        found += 1
    if not found:
        raise ValueError("the bootstrap has no access log to add timing to")
    return json.dumps(bootstrap)


def read_phase_log(path: Path) -> list[dict[str, Any]]:
    """Envoy's access-log lines (JSON with the timing fields) from its log file."""
    rows: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines():
        if MARK not in line or not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            continue
        rows.append(row)
    return rows


def logged_number(value: object) -> float | None:
    """A field of Envoy's access log as a number; None for a missing one ("-", "")."""
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value not in ("", "-"):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def breakdown(rows: Sequence[Mapping[str, Any]], tenant: str | None = None) -> dict[str, Any]:
    """Median (and P90) of each phase and step in ms over the answered requests (of the
    requests Envoy logged with `X-Bench-Tenant: tenant`, if given)."""
    chosen = [
        r
        for r in rows
        if str(r.get("status")) == "200" and (tenant is None or r.get("tenant_header") == tenant)
    ]
    phases: dict[str, dict[str, float]] = {}
    for name in PHASES:
        values = [v for r in chosen if (v := logged_number(r.get(name))) is not None]
        phases[name] = _summary(values)
    steps: dict[str, dict[str, float]] = {}
    for label, start, end in STEPS:
        values = []
        for r in chosen:
            stop = logged_number(r.get(end))
            begin = 0.0 if start is None else logged_number(r.get(start))
            if stop is not None and begin is not None:
                values.append(stop - begin)
        steps[label] = _summary(values)
    for name in EXT_PROC_FIELDS:
        values = [v for r in chosen if (v := logged_number(r.get(name))) is not None]
        if values:
            steps[EXT_PROC_STEPS[name]] = _summary(values)
    return {"requests": len(chosen), "phases_ms": phases, "steps_ms": steps}


def ext_proc_waits(breakdown_: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """How long Envoy waited for each ext_proc reply, from a `breakdown`, by field name
    (`ext_proc_request_header_latency_us`, ...); the fields no request logged are left out."""
    steps = breakdown_["steps_ms"]
    return {name: steps[label] for name, label in EXT_PROC_STEPS.items() if label in steps}


def details_by_tenant(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Per tenant, how many answers of each "status details" (504
    `ext_proc_error_per-message_timeout_exceeded`, `via_upstream`, ...)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = out.setdefault(str(row.get("tenant_header")), {})
        key = f"{row.get('status')} {row.get('details')}"
        counts[key] = counts.get(key, 0) + 1
    return out


def _summary(values_us: Sequence[float]) -> dict[str, float]:
    if not values_us:
        return {"p50": math.nan, "p90": math.nan, "count": 0}
    return {
        "p50": percentile(values_us, 50) / 1000.0,
        "p90": percentile(values_us, 90) / 1000.0,
        "count": len(values_us),
    }


def print_breakdown(by_arm: Mapping[str, Mapping[str, Any]]) -> None:
    """One row per step, one column per arm: median ms."""
    arms = list(by_arm)
    if not arms:
        return
    print("\nper-phase medians (ms, Envoy's access log), the quiet tenant's answered requests:")
    print(f"{'step':58}" + "".join(f"{arm:>16}" for arm in arms))
    labels = [label for label, _start, _end in STEPS]
    labels[2:2] = list(EXT_PROC_STEPS.values())[:2]
    labels[5:5] = list(EXT_PROC_STEPS.values())[2:]
    for label in labels:
        cells = []
        for arm in arms:
            step = by_arm[arm]["steps_ms"].get(label)
            value = math.nan if step is None else step["p50"]
            cells.append("-" if math.isnan(value) else f"{value:.3f}")
        print(f"{label:58}" + "".join(f"{cell:>16}" for cell in cells))
