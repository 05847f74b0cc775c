"""Structured logs: one JSON object per line (ts, level, logger, message, fields), or text."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import orjson
import pytest

from extproc.service.logs import JsonFormatter, configure_logging
from extproc.service.main import ServeOptions


def record(
    name: str, level: int, message: str, *args: object, **extra: object
) -> logging.LogRecord:
    made = logging.getLogger(name).makeRecord(name, level, __file__, 1, message, args, None)
    for key, value in extra.items():
        setattr(made, key, value)
    return made


def test_a_plain_message_has_the_standard_fields() -> None:
    entry = orjson.loads(
        JsonFormatter().format(record("extproc.serve", logging.INFO, "hi %s", "x"))
    )
    assert entry["level"] == "info" and entry["logger"] == "extproc.serve"
    assert entry["message"] == "hi x"
    assert entry["ts"].endswith("+00:00") and "T" in entry["ts"]


def test_fields_and_extra_keys_become_top_level() -> None:
    made = record("extproc.reload", logging.ERROR, "bad", fields={"errors": ["p.yaml:3: x"]}, n=2)
    entry = orjson.loads(JsonFormatter().format(made))
    assert entry["errors"] == ["p.yaml:3: x"] and entry["n"] == 2 and entry["level"] == "error"


def test_the_request_line_is_merged_not_nested() -> None:
    line = orjson.dumps({"request_id": "r1", "tenant": "acme", "outcome": "admitted"}).decode()
    entry = orjson.loads(JsonFormatter().format(record("extproc.request", logging.INFO, line)))
    assert entry["message"] == "request"
    assert entry["tenant"] == "acme" and entry["outcome"] == "admitted"


def test_exceptions_are_one_field_of_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        made = logging.getLogger("x").makeRecord(
            "x", logging.ERROR, __file__, 1, "failed", (), exc_info=__import__("sys").exc_info()
        )
    text = JsonFormatter().format(made)
    assert "\n" not in text
    assert "ValueError: boom" in orjson.loads(text)["exception"]


@pytest.fixture
def root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        logging.captureWarnings(False)


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_configure_logging_routes_every_logger(
    root_logging: None, log_format: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging(log_format, "INFO")
    logging.getLogger("aiohttp.server").warning("from a library")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    if log_format == "json":
        entry = orjson.loads(lines[0])
        assert entry["logger"] == "aiohttp.server" and entry["level"] == "warning"
    else:
        assert "WARNING aiohttp.server: from a library" in lines[0]


def test_options_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTPROC_DRAIN_GRACE", "12.5")
    monkeypatch.setenv("EXTPROC_LOG_FORMAT", "text")
    monkeypatch.setenv("EXTPROC_RELOAD_INTERVAL", "0")
    monkeypatch.setenv("EXTPROC_ADMIN_REMOTE_RELOAD", "true")
    options = ServeOptions.from_env("p.yaml", "127.0.0.1:1", "127.0.0.1:2")
    assert options.drain_grace == 12.5 and options.log_format == "text"
    assert options.reload_interval == 0 and options.allow_remote_reload
    monkeypatch.setenv("EXTPROC_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit):
        ServeOptions.from_env("p.yaml", "127.0.0.1:1", "127.0.0.1:2")
