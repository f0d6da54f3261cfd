"""The one logging configuration (log_config) and its JSON formatter: one parseable line per
record with UTC time, ids from `extra`, and exception text (the CLI and worker paths through
real processes are tested in tests/e2e/test_json_logs.py and test_flower.py)."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.core import logs
from app.core.logs import JsonFormatter
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


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """Put the root logger and the quiet loggers back as they were after a log_config()."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    quiet = {name: logging.getLogger(name).level for name in logs.QUIET_LOGGERS}
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            if handler not in saved[0]:
                root.removeHandler(handler)
                handler.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)


def test_log_config_writes_json_lines_at_its_level(tmp_path: Path, restored_logging: None) -> None:
    logfile = tmp_path / "worker.log"
    logs.apply(logs.log_config("info", "json", str(logfile)))
    logging.getLogger("tokenmill.test.switch").debug("not at INFO")
    logging.getLogger("httpx").info("HTTP Request: POST /generate")  # a quiet logger
    logging.getLogger("tokenmill.test.switch").warning(
        "server %s down", "gpu-b", extra={"server": "gpu-b", "action": "down"}
    )
    entries = [json.loads(line) for line in logfile.read_text().splitlines()]
    assert entries == [
        {
            "ts": entries[0]["ts"],
            "level": "WARNING",
            "logger": "tokenmill.test.switch",
            "message": "server gpu-b down",
            "server": "gpu-b",
            "action": "down",
        }
    ]


def test_log_config_chooses_its_format_at_the_first_record(
    tmp_path: Path, restored_logging: None
) -> None:
    asked: list[str] = []

    def choose() -> str:
        asked.append("format")
        return "text"

    logfile = tmp_path / "cli.log"
    logs.apply(logs.log_config("WARNING", choose, str(logfile)))
    assert asked == []  # nothing logged yet: the settings are not read
    logging.getLogger("tokenmill.test.text").warning("first")
    logging.getLogger("tokenmill.test.text").error("second")
    assert asked == ["format"]
    lines = logfile.read_text().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [
        "WARNING tokenmill.test.text: first",
        "ERROR tokenmill.test.text: second",
    ]


def test_log_format_setting_is_case_insensitive_and_checked() -> None:
    assert Settings(log_format="JSON").log_format == "json"
    assert Settings().log_format == "text"
    with pytest.raises(ValueError):
        Settings(log_format="xml")
