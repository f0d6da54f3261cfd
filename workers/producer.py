"""The producer: stream prompts, template and tokenize them, write ledger rows, publish ids.

A bad line is reported with its number and skipped; a rerun inserts and publishes nothing
new; each chunk is one transaction, so nothing half-written is left behind.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from app import ledger
from app.chat_path import ChatInputs, check_version, merge_template_kwargs
from app.constants import EVENT_ENQUEUED, EVENT_RUN_CREATED
from app.contracts import PromptRecord, SamplingParams
from app.conversation import TurnPlan
from app.errors import InputError
from app.input_formats import open_table
from app.inputs import read_prompts
from app.template_pool import Templater
from app.tokenization import ChatTokenizer, check_template_kwargs
from workers import turns

log = logging.getLogger(__name__)

CHUNK_LINES = 512


@dataclass(frozen=True)
class EnqueueOptions:
    input_path: Path
    run: str
    sampling: SamplingParams
    samples_per_prompt: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # the field (column) holding the prompt, instead of the JSONL field names
    prompt_field: str | None = None
    # "all": one item per assistant turn, chained (workers/turns.py); pinned by the run
    turns: str = "last"
    trust_remote_code: bool = False
    # processes templating a slow (pure-Python) tokenizer; None: one per core
    template_processes: int | None = None


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
    # field, id, system, tools, chat_template_kwargs, reasoning_effort) and those kept as
    # row metadata (exported with each sample)
    prompt_fields: dict[str, int] = field(default_factory=dict)
    metadata_fields: dict[str, int] = field(default_factory=dict)

    def count_fields(self, record: PromptRecord) -> None:
        for name in record.prompt_fields:
            self.prompt_fields[name] = self.prompt_fields.get(name, 0) + 1
        for name in record.metadata or {}:
            self.metadata_fields[name] = self.metadata_fields.get(name, 0) + 1

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
            "metadata_fields": dict(self.metadata_fields),
            "errors": [{"line": e.line, "reason": e.reason} for e in self.errors],
        }


Publish = Callable[[list[int]], None]


def _chunks(records: Iterator[PromptRecord | InputError], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for record in records:
        chunk.append(record)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def row_kwargs(run_kwargs: dict[str, Any], record: PromptRecord) -> dict[str, Any] | None:
    """The record's template kwargs merged over the run's; None when it has none of its own
    (the item then uses the run's)."""
    if record.chat_template_kwargs is None and record.reasoning_effort is None:
        return None
    return merge_template_kwargs(run_kwargs, record.chat_template_kwargs, record.reasoning_effort)


@dataclass
class _Chunk:
    """One chunk of records on its way: templated (maybe in another process), then stored."""

    records: list[PromptRecord]
    plans: dict[str, list[TurnPlan]]
    lines: int
    ids: Future[list[list[int] | InputError]]


def _submit(
    templater: Templater, records: list[PromptRecord], kwargs: dict[str, Any]
) -> Future[list[list[int] | InputError]]:
    """Template the chat records of a chunk; pre-tokenized records keep their ids."""
    chat = [
        ChatInputs(r.messages or [], r.tools, row_kwargs(kwargs, r) or kwargs, normalized=True)
        for r in records
        if r.messages is not None
    ]
    templated = templater.submit(chat)
    out: Future[list[list[int] | InputError]] = Future()

    def merge(done: Future[list[list[int] | InputError]]) -> None:
        try:
            rows = iter(done.result())
        except Exception as exc:
            out.set_exception(exc)
            return
        merged: list[list[int] | InputError] = []
        for r in records:
            if r.input_ids is not None:
                merged.append(list(r.input_ids))
                continue
            ids = next(rows)
            if isinstance(ids, InputError):  # the line that breaks the template
                ids = InputError(ids.reason, r.line)
            merged.append(ids)
        out.set_result(merged)

    templated.add_done_callback(merge)
    return out


def enqueue(
    db: Engine,
    tokenizer: ChatTokenizer,
    options: EnqueueOptions,
    *,
    publish: Publish | None,
    on_error: Callable[[InputError], None] = lambda e: None,
    on_progress: Callable[[int], None] = lambda n: None,
) -> EnqueueReport:
    """Stream options.input_path into the ledger; publish new ids when publish is given."""
    report = EnqueueReport(run=options.run)
    # Read the first line before writing anything: a file that is missing, unreadable or
    # empty is refused with no run created.
    check_template_kwargs(options.chat_template_kwargs)
    entries = read_prompts(
        options.input_path, field=options.prompt_field, content_format=tokenizer.content_format
    )
    unit = "row" if open_table(options.input_path) is not None else "line"
    first = next(entries, None)
    if first is None:
        raise InputError(
            f"the prompts file {str(options.input_path)!r} is empty (no non-blank lines): "
            "nothing to enqueue"
        )
    spec = ledger.RunSpec(
        name=options.run,
        tokenizer_path=str(tokenizer.path),
        tokenizer_hash=tokenizer.tokenizer_hash,
        tokenizer_files=tokenizer.tokenizer_files,
        legacy_tokenizer_hash=tokenizer.legacy_hash,
        chat_template_hash=tokenizer.chat_template_hash,
        chat_template_kwargs=options.chat_template_kwargs,
        sampling=options.sampling,
        samples_per_prompt=options.samples_per_prompt,
        think_end_id=tokenizer.think_end_id,
        eos_token_ids=list(tokenizer.eos_token_ids),
        turns=options.turns,
        trust_remote_code=options.trust_remote_code,
    )
    with db.begin() as conn:
        run, created = ledger.get_or_create_run(conn, spec)
        # later enqueues build prompts with the rules the run pinned (or are refused)
        check_version(run.normalization_version, run=run.name)
        report.run_created = created
        if created:
            ledger.record_event(
                conn,
                EVENT_RUN_CREATED,
                f"run {run.name} created: tokenizer {spec.tokenizer_path}, "
                f"sampling {spec.sampling.to_json()}",
                run_id=run.id,
            )
    context = tokenizer.context_length
    published_after = 0
    analyzed_at = 0

    def fail(error: InputError) -> None:
        if error.line is not None and error.unit != unit:  # rows of a Parquet/datasets input
            error = InputError(error.reason, error.line, unit=unit)
        report.errors.append(error)
        on_error(error)

    def store(new_items: list[ledger.NewItem], lines: int) -> None:
        nonlocal analyzed_at, published_after
        with db.begin() as conn:
            report.inserted += ledger.insert_items(conn, run.id, new_items)
            turns.link_chains(conn, run.id, new_items)
            analyzed_at = _maybe_analyze(conn, report.inserted, analyzed_at)
        if publish is not None:
            published_after = _publish_pending(db, run.id, publish, published_after, report)
        on_progress(lines)

    def finish(chunk: _Chunk) -> list[ledger.NewItem]:
        new_items: list[ledger.NewItem] = []
        for record, ids in zip(chunk.records, chunk.ids.result(), strict=True):
            if isinstance(ids, InputError):
                fail(ids)
                continue
            if not ids:
                fail(InputError("the prompt is empty after templating", record.line))
                continue
            if context is not None and len(ids) >= context:
                fail(
                    InputError(
                        f"prompt has {len(ids)} tokens, at or over the model's context "
                        f"length {context}",
                        record.line,
                    )
                )
                continue
            new_items.extend(
                turns.chain_items(
                    record,
                    ids,
                    options.samples_per_prompt,
                    chunk.plans.get(record.key),
                    row_kwargs(options.chat_template_kwargs, record),
                )
            )
        return new_items

    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-enqueue-writer")
    templater = Templater(tokenizer, options.template_processes)
    # chunks templated ahead: one per templating process, plus one being stored
    in_flight: deque[_Chunk] = deque()
    pending: Future[None] | None = None

    def store_next() -> None:
        nonlocal pending
        chunk = in_flight.popleft()
        new_items = finish(chunk)
        # the database work of a chunk overlaps the templating of the next ones; one chunk
        # stored at a time, so order is kept and memory stays bounded
        if pending is not None:
            pending.result()
        pending = writer.submit(store, new_items, chunk.lines)

    try:
        for chunk in _chunks(itertools.chain([first], entries), CHUNK_LINES):
            records: list[PromptRecord] = []
            for entry in chunk:
                if isinstance(entry, InputError):
                    fail(entry)
                else:
                    records.append(entry)
                    report.count_fields(entry)
            report.lines = max(report.lines, *(entry.line or 0 for entry in chunk))
            present: set[str] = set()
            if not report.run_created:  # a new run has no keys but this file's (unique)
                with db.connect() as conn:
                    present = ledger.existing_keys(conn, run.id, (r.key for r in records))
            fresh = [r for r in records if r.key not in present]
            report.already_present += len(records) - len(fresh)
            report.prompts += len(records)
            plans: dict[str, list[TurnPlan]] = {}
            if options.turns == "all":  # template turn 0 now; later turns wait for it
                fresh = turns.first_turns(fresh, plans, fail)
            ids = _submit(templater, fresh, options.chat_template_kwargs)
            in_flight.append(_Chunk(fresh, plans, report.lines, ids))
            if len(in_flight) > templater.processes:
                store_next()
        while in_flight:
            store_next()
        if pending is not None:
            pending.result()
    finally:
        templater.close()
        writer.shutdown(wait=True)
    if publish is not None:
        _publish_pending(db, run.id, publish, published_after, report)
    with db.begin() as conn:
        if report.inserted:
            ledger.refresh_statistics(conn)
        ledger.record_event(
            conn,
            EVENT_ENQUEUED,
            f"{report.inserted} items inserted, {report.published} published, "
            f"{report.already_present} prompts already present, {report.skipped} lines skipped",
            run_id=run.id,
            details=report.to_json() | {"errors": report.to_json()["errors"][:50]},
        )
    log.info(
        "enqueue %s: %s", options.run, {k: v for k, v in report.to_json().items() if k != "errors"}
    )
    return report


def _maybe_analyze(conn: Any, inserted: int, analyzed_at: int) -> int:
    """Refresh planner statistics each time the run has doubled (at least 20,000 rows)."""
    if inserted >= max(20_000, 2 * analyzed_at):
        ledger.refresh_statistics(conn)
        return inserted
    return analyzed_at


def _publish_pending(
    db: Engine, run_id: int, publish: Publish, after_id: int, report: EnqueueReport
) -> int:
    """Publish every still-pending item of the run (new ones, and ones a crash left behind)."""
    while True:
        with db.connect() as conn:
            ids = ledger.pending_ids(conn, run_id, after_id=after_id)
        if not ids:
            return after_id
        publish(ids)
        with db.begin() as conn:
            ledger.mark_queued(conn, ids)
        report.published += len(ids)
        after_id = ids[-1]
