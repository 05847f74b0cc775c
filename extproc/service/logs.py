"""The service's log format: one JSON object per line (or plain text), to stderr."""

from __future__ import annotations

import datetime as dt
import logging
import sys
import traceback
from typing import Any

import orjson

# LogRecord attributes that are not user fields.
_RECORD_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "fields",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then the record's fields.

    Fields come from `extra={"fields": {...}}` (or other `extra` keys). A message that is
    itself a JSON object (the per-request line of "extproc.request") is merged as fields.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        message = record.getMessage()
        merged = False
        if message.startswith("{") and message.endswith("}"):
            try:
                parsed = orjson.loads(message)
            except orjson.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                entry["message"] = "request" if record.name == "extproc.request" else ""
                entry.update(parsed)
                merged = True
        if not merged:
            entry["message"] = message
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        for key, value in vars(record).items():
            if key not in _RECORD_KEYS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        if record.stack_info:
            entry["stack"] = record.stack_info
        return orjson.dumps(entry, default=str).decode()


def configure_logging(log_format: str = "json", level: int | str | None = None) -> None:
    """Route every logger of the process to stderr in one format (replaces handlers)."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    configured = bool(root.handlers)
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    if level is not None:
        root.setLevel(level if isinstance(level, int) else level.upper())
    elif not configured:
        root.setLevel(logging.INFO)
    logging.captureWarnings(True)
