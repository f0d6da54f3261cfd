"""Log formatting for log shippers: one JSON object per line, ids as fields, UTC timestamps;
and the filter that keeps transformers' no-PyTorch advice out of every log.

Used by the CLI (`--log-format json`) and by Celery workers (`TOKENMILL_LOG_FORMAT=json`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
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


def use_json(handlers: Iterable[logging.Handler]) -> None:
    """Switch these handlers to JSON lines."""
    formatter = JsonFormatter()
    for handler in handlers:
        handler.setFormatter(formatter)


__all__ = ["JsonFormatter", "use_json"]


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
