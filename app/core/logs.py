"""Logging, configured in one place: `log_config()` is the `logging.config.dictConfig` dict that
the CLI applies at start and Celery workers apply from its `setup_logging` signal. Text lines or
JSON lines for log shippers (one object per line, ids as fields, UTC timestamps), the HTTP
clients' per-request lines kept out, and transformers' no-PyTorch advice filtered.

State-change lines carry an `action` in `extra` (`paused`, `resumed`, `failed`, ...): a JSON
line's field, and what a log query selects on.
"""

from __future__ import annotations

import json
import logging
import logging.config
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

# attributes every LogRecord has; anything else on a record came from `extra=`
_RECORD_ATTRS = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
    | {"message", "asctime", "taskName"}
)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: ts, level, logger, message, the record's `extra`
    fields, and `exc`/`stack` text when present (newlines escaped, so still one line)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=_fallback, ensure_ascii=False)


def _fallback(value: object) -> str:
    """A field json cannot encode (a path, an exception, a datetime) is written as its str."""
    return str(value)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# one line per HTTP request at INFO would drown the state changes the log is for
QUIET_LOGGERS = ("httpx", "httpcore", "alembic.runtime.migration")


class ChosenFormatter(logging.Formatter):
    """Text or JSON lines as `choose()` says, asked at the first record: reading the settings
    loads pydantic, which `--help` and commands that never log need not pay for."""

    def __init__(self, choose: Callable[[], str]) -> None:
        super().__init__(TEXT_FORMAT)
        self._choose = choose
        self._chosen: logging.Formatter | None = None

    def format(self, record: logging.LogRecord) -> str:
        if self._chosen is None:
            self._chosen = formatter(self._choose())
        return self._chosen.format(record)


def formatter(log_format: str) -> logging.Formatter:
    """The formatter of a log format: "json" lines, else text."""
    return JsonFormatter() if log_format.lower() == "json" else logging.Formatter(TEXT_FORMAT)


def log_config(
    level: str | int, log_format: str | Callable[[], str], logfile: str | None = None
) -> dict[str, Any]:
    """The one logging configuration, for `logging.config.dictConfig`: records at `level` and
    above to stderr (or `logfile`), formatted as `log_format` says ("text" or "json", or a
    callable asked at the first record), with the quiet loggers at WARNING."""
    chosen: dict[str, Any]
    if callable(log_format):
        chosen = {"()": ChosenFormatter, "choose": log_format}
    else:
        chosen = {"()": formatter, "log_format": log_format}
    handler: dict[str, Any] = (
        {"class": "logging.FileHandler", "filename": logfile, "encoding": "utf-8"}
        if logfile
        else {"class": "logging.StreamHandler", "stream": sys.stderr}
    )
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    return {
        "version": 1,
        "disable_existing_loggers": False,  # module loggers made at import keep working
        "formatters": {"tokenmill": chosen},
        "handlers": {"stderr": {**handler, "formatter": "tokenmill"}},
        "loggers": {name: {"level": "WARNING"} for name in QUIET_LOGGERS},
        "root": {"level": level, "handlers": ["stderr"]},
    }


def apply(config: dict[str, Any]) -> None:
    """Apply a `log_config()` dict, and drop transformers' no-PyTorch advice (a filter on its
    logger, which transformers configures itself when it is imported)."""
    logging.config.dictConfig(config)
    quiet_transformers()


__all__ = ["JsonFormatter", "apply", "formatter", "log_config"]


class _NoTorchAdvice(logging.Filter):
    """tokenmill needs only tokenizers: transformers' "PyTorch was not found" line is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PyTorch was not found" not in record.getMessage()


def quiet_transformers() -> None:
    """Drop transformers' no-PyTorch advice, which it logs once, when `transformers` is first
    imported. Called at process start (CLI, workers) as well as before loading a tokenizer, so
    it holds whichever import comes first; every other transformers record passes."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchAdvice) for f in logger.filters):
        logger.addFilter(_NoTorchAdvice())
