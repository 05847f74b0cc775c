"""Request traces: read CSV / JSONL files as they are published, then shape them for a run.

Recognised columns (case-insensitive, CSV header or JSONL keys):

- time: ``TIMESTAMP`` (Azure 2023: datetime strings), ``timestamp`` (Mooncake: milliseconds;
  anything else: seconds unless `time_unit` says otherwise), ``time``, ``arrival``,
  ``arrival_time``, ``timestamp_ms`` (milliseconds), ``timestamp_s``;
- input tokens: ``ContextTokens`` (Azure), ``input_length`` (Mooncake), ``input_tokens``,
  ``prompt_tokens``;
- output tokens: ``GeneratedTokens`` (Azure), ``output_length`` (Mooncake), ``output_tokens``,
  ``completion_tokens``;
- tenant (optional): ``tenant``, ``client``, ``client_id``, ``user``;
- priority (optional): ``priority``, the integer vLLM request priority the engine schedules by
  under ``scheduling_policy="priority"`` (lower first; absent = 0);
- prefix block hashes (optional): ``hash_ids`` (Mooncake: a JSON list, one id per
  `HASH_BLOCK_TOKENS`-token block of the prompt, equal ids for equal prefixes), which the
  engines' prefix caches key their blocks by (absent = every prompt is fresh).

Times become seconds from the first request; token counts are clamped to at least 1 (an engine
needs one prompt token and generates at least one).
"""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

TimeUnit = Literal["auto", "s", "ms"]

_TIME_KEYS = ("timestamp", "time", "arrival", "arrival_time", "timestamp_s", "timestamp_ms")
_INPUT_KEYS = ("contexttokens", "input_length", "input_tokens", "prompt_tokens")
_OUTPUT_KEYS = ("generatedtokens", "output_length", "output_tokens", "completion_tokens")
_TENANT_KEYS = ("tenant", "client", "client_id", "user")
_PRIORITY_KEYS = ("priority",)
_HASH_KEYS = ("hash_ids",)

HASH_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` block (Mooncake's traces hash 512-token blocks)."""


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives and how many tokens it reads and writes."""

    at: float
    """Arrival, seconds from the start of the trace."""
    input_tokens: int
    output_tokens: int
    tenant: str | None = None
    priority: int = 0
    """vLLM's request priority (lower first), used by engines with the "priority" policy."""
    hash_ids: tuple[int, ...] = ()
    """Ids of the prompt's `HASH_BLOCK_TOKENS`-token blocks (equal ids, equal prefix)."""

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class _Columns:
    time: str
    input: str
    output: str
    tenant: str | None
    priority: str | None
    hash_ids: str | None
    unit: Literal["s", "ms", "datetime"]


def _find(keys: Iterable[str], wanted: Sequence[str]) -> str | None:
    lowered = {key.lower(): key for key in keys}
    for name in wanted:
        if name in lowered:
            return lowered[name]
    return None


def _columns(keys: Iterable[str], sample: Mapping[str, Any], unit: TimeUnit, file: str) -> _Columns:
    keys = list(keys)
    time_key = _find(keys, _TIME_KEYS)
    input_key = _find(keys, _INPUT_KEYS)
    output_key = _find(keys, _OUTPUT_KEYS)
    missing = [
        what
        for what, key in (("time", time_key), ("input tokens", input_key), ("output", output_key))
        if key is None
    ]
    if missing or time_key is None or input_key is None or output_key is None:
        raise TraceError(
            f"{file}: no column for {', '.join(missing)}; columns are {', '.join(keys)}"
        )
    kind: Literal["s", "ms", "datetime"]
    value = sample[time_key]
    if isinstance(value, str) and not _is_number(value):
        kind = "datetime"
    elif unit != "auto":
        kind = unit
    elif time_key.lower() == "timestamp_ms" or input_key.lower() == "input_length":
        kind = "ms"  # Mooncake traces count milliseconds
    else:
        kind = "s"
    return _Columns(
        time_key,
        input_key,
        output_key,
        _find(keys, _TENANT_KEYS),
        _find(keys, _PRIORITY_KEYS),
        _find(keys, _HASH_KEYS),
        kind,
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _parse_datetime(text: str) -> float:
    """Seconds since the epoch of 'YYYY-MM-DD HH:MM:SS[.fffffff]' (any number of digits)."""
    text = text.strip()
    head, _, fraction = text.partition(".")
    seconds = datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp()
    return seconds + (float("0." + fraction) if fraction else 0.0)


def _time(value: Any, unit: Literal["s", "ms", "datetime"]) -> float:
    if unit == "datetime":
        return _parse_datetime(str(value))
    number = float(value)
    return number / 1000.0 if unit == "ms" else number


def _rows(path: Path) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """(line number, record) for a CSV or JSONL file."""
    with path.open("r", encoding="utf-8", newline="") as handle:
        first = handle.readline()
        handle.seek(0)
        if first.lstrip().startswith("{"):
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise TraceError(f"{path}:{number}: invalid JSON: {exc.msg}") from None
                    if not isinstance(record, dict):
                        raise TraceError(f"{path}:{number}: expected a JSON object")
                    yield number, record
        else:
            for number, row in enumerate(csv.DictReader(handle), start=2):
                yield number, row


def read_trace(path: str | Path, *, time_unit: TimeUnit = "auto") -> list[TraceRequest]:
    """Every request of a CSV or JSONL trace, sorted by arrival, times from the first one."""
    path = Path(path)
    try:
        rows = list(_rows(path))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    if not rows:
        raise TraceError(f"{path}: no requests")
    columns = _columns(rows[0][1].keys(), rows[0][1], time_unit, str(path))
    raw: list[tuple[float, int, int, str | None, int, tuple[int, ...]]] = []
    for number, row in rows:
        try:
            at = _time(row[columns.time], columns.unit)
            input_tokens = int(float(row[columns.input]))
            output_tokens = int(float(row[columns.output]))
            priority_value = None if columns.priority is None else row.get(columns.priority)
            priority = 0 if priority_value in (None, "") else int(priority_value)
            hash_ids = _hash_ids(None if columns.hash_ids is None else row.get(columns.hash_ids))
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{number}: cannot read the request: {exc}") from None
        tenant = None
        if columns.tenant is not None:
            value = row.get(columns.tenant)
            tenant = None if value is None or value == "" else str(value)
        raw.append((at, max(1, input_tokens), max(1, output_tokens), tenant, priority, hash_ids))
    raw.sort(key=lambda item: item[0])
    start = raw[0][0]
    return [TraceRequest(at - start, i, o, t, p, h) for at, i, o, t, p, h in raw]


def _hash_ids(value: Any) -> tuple[int, ...]:
    """A `hash_ids` cell: a JSON list of integers (a CSV cell holds it as JSON text)."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError("hash_ids must be a list of integers")
    return tuple(value)


def shape_trace(
    requests: Sequence[TraceRequest],
    *,
    rate_scale: float = 1.0,
    duration: float | None = None,
    start: float = 0.0,
    sample: float = 1.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Cut and scale a trace.

    start: skip the requests before this trace time; rate_scale: divide inter-arrival times
    (2.0 = twice the request rate); duration: keep the arrivals in the first `duration`
    seconds *after* scaling; sample: keep each request with this probability (seeded).
    Times restart at 0.
    """
    if rate_scale <= 0:
        raise ValueError("rate_scale must be > 0")
    if not 0 < sample <= 1:
        raise ValueError("sample must be in (0, 1]")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for request in requests:
        if request.at < start:
            continue
        at = (request.at - start) / rate_scale
        if duration is not None and at >= duration:
            break
        if sample < 1.0 and rng.random() >= sample:
            continue
        out.append(replace(request, at=at))
    return out


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """Write a trace as JSONL (seconds), readable by `read_trace`."""
    with Path(path).open("w", encoding="utf-8") as handle:
        for request in requests:
            record: dict[str, Any] = {
                "time": round(request.at, 6),
                "input_tokens": request.input_tokens,
                "output_tokens": request.output_tokens,
            }
            if request.tenant is not None:
                record["tenant"] = request.tenant
            if request.priority:
                record["priority"] = request.priority
            if request.hash_ids:
                record["hash_ids"] = list(request.hash_ids)
            handle.write(json.dumps(record) + "\n")
