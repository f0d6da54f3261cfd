"""The JSON log formatter: one parseable line per record with UTC time, ids from `extra`,
and exception text (the CLI and worker paths are tested in tests/e2e/test_flower.py)."""

from __future__ import annotations

import io
import json
import logging
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.core.logs import JsonFormatter, use_json
from app.core.settings import Settings


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("tokenmill.test")
    return logger.makeRecord(
        logger.name, logging.INFO, __file__, 1, message, args, None, extra=extra or None
    )


def test_fields_message_and_utc_timestamp() -> None:
    line = JsonFormatter().format(record("item %d done on %s", 7, "gpu-a"))
    entry = json.loads(line)
    assert entry["level"] == "INFO"
    assert entry["logger"] == "tokenmill.test"
    assert entry["message"] == "item 7 done on gpu-a"
    ts = datetime.fromisoformat(entry["ts"])
    assert ts.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - ts) < timedelta(minutes=1)
    # nothing of the LogRecord's own bookkeeping leaks in
    assert set(entry) == {"ts", "level", "logger", "message"}


def test_extra_fields_become_top_level_fields() -> None:
    line = JsonFormatter().format(
        record("released", run="r1", item=42, server="gpu-a", path=Path("/x"))
    )
    entry = json.loads(line)
    assert entry["run"] == "r1" and entry["item"] == 42 and entry["server"] == "gpu-a"
    assert entry["path"] == "/x"  # not JSON-encodable: written as its str


def test_exception_text_stays_on_one_line() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logger = logging.getLogger("tokenmill.test")
        rec = logger.makeRecord(
            logger.name, logging.ERROR, __file__, 1, "failed\nbadly", (), sys.exc_info()
        )
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "failed\nbadly"
    assert "Traceback" in entry["exc"] and "ValueError: bad\nthing" in entry["exc"]


def test_use_json_switches_handlers() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("tokenmill.test.switch")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        use_json([handler])
        logger.warning("server %s down", "gpu-b", extra={"server": "gpu-b"})
    finally:
        logger.removeHandler(handler)
    entry = json.loads(stream.getvalue())
    assert entry == {
        "ts": entry["ts"],
        "level": "WARNING",
        "logger": "tokenmill.test.switch",
        "message": "server gpu-b down",
        "server": "gpu-b",
    }


def test_log_format_setting_is_case_insensitive_and_checked() -> None:
    assert Settings(log_format="JSON").log_format == "json"
    assert Settings().log_format == "text"
    with pytest.raises(ValueError):
        Settings(log_format="xml")
