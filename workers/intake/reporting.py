"""The report stage of an enqueue: what it counted and refused, the error and progress callbacks,
and the timeline events that close it (enqueued, or stopped with what a rerun completes)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from app.core.constants import EVENT_ENQUEUE_STOPPED, EVENT_ENQUEUED
from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.ledger import event_log, queue
from app.prompts import request_fields
from app.sglang.render import RenderServerUnavailable

log = logging.getLogger(__name__)

KEY_FIELDS = ("id",)  # top-level fields that give the item key


@dataclass
class EnqueueReport:
    run: str
    run_created: bool = False
    lines: int = 0
    prompts: int = 0
    inserted: int = 0
    already_present: int = 0
    published: int = 0
    errors: list[InputError] = field(default_factory=list)
    # top-level fields, and how many rows had each: those that built the prompts (the prompt
    # field, system, tools, chat_template_kwargs, reasoning_effort, sampling_params), the item
    # key (id), and those kept as row metadata (exported with each sample)
    prompt_fields: dict[str, int] = field(default_factory=dict)
    key_fields: dict[str, int] = field(default_factory=dict)
    metadata_fields: dict[str, int] = field(default_factory=dict)
    # request fields of the rows that change no prompt at SGLang's chat path
    # (request_fields.NOT_APPLIED), by how many rows gave each a value
    not_applied_fields: dict[str, int] = field(default_factory=dict)
    # the distinct image sources read and stored (each once) and their bytes, and those that
    # could not be used (unreadable, or no usable image: nothing stored, their rows skipped)
    images_read: int = 0
    image_bytes_read: int = 0
    images_refused: int = 0

    def count_fields(self, record: PromptRecord) -> None:
        for name in record.prompt_fields:
            # the id names the item; it is no part of the prompt
            counted = self.key_fields if name in KEY_FIELDS else self.prompt_fields
            counted[name] = counted.get(name, 0) + 1
        for name, value in (record.metadata or {}).items():
            self.metadata_fields[name] = self.metadata_fields.get(name, 0) + 1
            if name in request_fields.NOT_APPLIED and value is not None:
                self.not_applied_fields[name] = self.not_applied_fields.get(name, 0) + 1

    @property
    def skipped(self) -> int:
        return len(self.errors)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "run_created": self.run_created,
            "prompts": self.prompts,
            "inserted": self.inserted,
            "already_present": self.already_present,
            "published": self.published,
            "skipped": self.skipped,
            "prompt_fields": dict(self.prompt_fields),
            "key_fields": dict(self.key_fields),
            "metadata_fields": dict(self.metadata_fields),
            "not_applied_fields": dict(self.not_applied_fields),
            "images_read": self.images_read,
            "image_bytes_read": self.image_bytes_read,
            "images_refused": self.images_refused,
            "errors": [{"line": e.line, "reason": e.reason} for e in self.errors],
        }

    def counts(self) -> dict[str, Any]:
        """to_json without the errors: what a log line or an event's details carry."""
        return {k: v for k, v in self.to_json().items() if k != "errors"}


class Reporter:
    """The report of one enqueue and the caller's callbacks. Every stage hands it the lines it
    refuses (fail) and the writer thread the lines it stored (progress)."""

    def __init__(
        self,
        report: EnqueueReport,
        *,
        unit: str,
        on_error: Callable[[InputError], None],
        on_progress: Callable[[int], None],
    ) -> None:
        self.report = report
        self._unit = unit  # "line" (JSONL) or "row" (Parquet, datasets): how errors name them
        self._on_error = on_error
        self._on_progress = on_progress

    def fail(self, error: InputError) -> None:
        """A line (row) is refused with its reason; the rest proceeds."""
        if error.line is not None and error.unit != self._unit:
            error = InputError(error.reason, error.line, unit=self._unit)
        self.report.errors.append(error)
        self._on_error(error)

    def progress(self, lines: int) -> None:
        """Everything up to this line is stored."""
        self._on_progress(lines)

    def finished(self, db: Engine, run_id: int) -> EnqueueReport:
        """The enqueue is complete: statistics refreshed if it inserted, the event recorded."""
        report = self.report
        with db.begin() as conn:
            if report.inserted:
                queue.refresh_statistics(conn)
            event_log.record_event(
                conn,
                EVENT_ENQUEUED,
                f"{report.inserted} items inserted, {report.published} published, "
                f"{report.already_present} prompts already present, {report.skipped} lines "
                "skipped",
                run_id=run_id,
                details=report.to_json() | {"errors": report.to_json()["errors"][:50]},
            )
        log.info("enqueue %s: %s", report.run, report.counts(), extra={"action": "enqueued"})
        return report

    def stopped(
        self, db: Engine, run_id: int, first_line: int | None, exc: RenderServerUnavailable
    ) -> RenderServerUnavailable:
        """The enqueue stops: recorded as an event, and said so that a rerun completes it."""
        report = self.report
        message = (
            f"enqueue of run {report.run} stopped: {exc}. {report.inserted} items were stored; "
            f"nothing from line {first_line} on was. Run the same enqueue again to complete the "
            "run (stored prompts are skipped, none is duplicated)."
        )
        with db.begin() as conn:
            event_log.record_event(
                conn, EVENT_ENQUEUE_STOPPED, message, run_id=run_id, details=report.counts()
            )
        log.error(message, extra={"action": "enqueue_stopped"})
        return RenderServerUnavailable(message)
