"""The producer: stream prompts, template and tokenize them, write ledger rows, publish ids.

A bad line is reported with its number and skipped; a rerun inserts and publishes nothing
new; each chunk is one transaction, so nothing half-written is left behind.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from app import ledger
from app.core.constants import EVENT_ENQUEUE_STOPPED, EVENT_ENQUEUED, EVENT_RUN_CREATED
from app.core.contracts import PromptRecord, SamplingParams
from app.core.errors import InputError
from app.prompts.chat_path import ChatInputs, check_version, merge_template_kwargs
from app.prompts.conversation import TurnPlan
from app.prompts.input_formats import open_table
from app.prompts.inputs import read_prompts
from app.prompts.render import RenderClient, RenderServerUnavailable, prompt_request
from app.prompts.template_pool import Templater
from app.prompts.tokenization import ChatTokenizer, check_template_kwargs
from workers.intake import cycles, turns

log = logging.getLogger(__name__)

CHUNK_LINES = 512
PENDING_PAGE = 5000  # ledger.pending_keys' page


@dataclass(frozen=True)
class EnqueueOptions:
    input_path: Path
    run: str
    sampling: SamplingParams
    samples_per_prompt: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # the field (column) holding the prompt, instead of the JSONL field names
    prompt_field: str | None = None
    # "all": one item per assistant turn, chained (workers/intake/turns.py); "each": one independent
    # item per assistant turn on the original history (boundary samples); pinned by the run
    turns: str = "last"
    trust_remote_code: bool = False
    # `--render-with URL`: every prompt built by that server's /v1/tokenize; pinned by the run
    render_with: str | None = None
    # `--require-parity`: servers whose rendering differs from the stored prompts stay paused
    require_parity: bool = False
    # ids per generate message; a `--turns each` conversation's items share one message
    batch_size: int = 32
    # processes templating a slow (pure-Python) tokenizer; None: one per core
    template_processes: int | None = None
    # `--weight-version V`: only servers reporting V serve the run (pinned)
    weight_version: str | None = None
    # `--reasoning-effort a,b,c`: sample k is templated with the k-th effort (pinned)
    reasoning_efforts: tuple[str | float, ...] = ()


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
    # `--turns each`: the regenerated assistant turn of each record (None in other modes)
    turn_of: list[int] | None = None


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


def _render(
    client: RenderClient, records: list[PromptRecord], kwargs: dict[str, Any]
) -> list[list[int] | InputError]:
    """Prompt ids from the render server for each chat record, as local templating gives
    them; pre-tokenized records keep their ids. RenderServerUnavailable passes through."""
    out: list[list[int] | InputError] = [list(r.input_ids or []) for r in records]
    chat = [(i, r) for i, r in enumerate(records) if r.messages is not None]
    rendered = client.render_many(
        [
            prompt_request(r.messages or [], row_kwargs(kwargs, r) or kwargs, tools=r.tools)
            for _, r in chat
        ]
    )
    for (i, r), ids in zip(chat, rendered, strict=True):
        out[i] = (
            InputError(f"the render server refused the prompt: {ids}", r.line)
            if isinstance(ids, Exception)
            else ids
        )
    return out


def enqueue(
    db: Engine,
    tokenizer: ChatTokenizer,
    options: EnqueueOptions,
    *,
    publish: Publish | None,
    renderer: RenderClient | None = None,
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
        render_with=options.render_with,
        require_parity=options.require_parity,
        weight_version=options.weight_version,
        reasoning_efforts=options.reasoning_efforts,
    )
    if (renderer is None) != (options.render_with is None):
        raise ValueError("a renderer is given exactly when options.render_with is set")
    kwargs = options.chat_template_kwargs

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
    spp = options.samples_per_prompt
    group_size = options.batch_size if run.turns == "each" else None
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
            if options.turns == "all":
                turns.link_chains(conn, run.id, new_items)
            analyzed_at = _maybe_analyze(conn, report.inserted, analyzed_at)
        if publish is not None:
            published_after = _publish_pending(
                db, run.id, publish, published_after, report, group_size
            )
        on_progress(lines)

    def finish(chunk: _Chunk) -> list[ledger.NewItem]:
        new_items: list[ledger.NewItem] = []
        built = chunk.ids.result()
        for position, (record, ids) in enumerate(zip(chunk.records, built, strict=True)):
            turn = None if chunk.turn_of is None else chunk.turn_of[position]
            where = "" if turn is None else f"turn {turn}: "
            if isinstance(ids, InputError):
                fail(InputError(where + ids.reason, ids.line))
                continue
            if not ids:
                fail(InputError(f"{where}the prompt is empty after templating", record.line))
                continue
            if context is not None and len(ids) >= context:
                fail(
                    InputError(
                        f"{where}prompt has {len(ids)} tokens, at or over the model's "
                        f"context length {context}",
                        record.line,
                    )
                )
                continue
            merged = row_kwargs(options.chat_template_kwargs, record)
            if turn is not None:
                new_items.extend(
                    ledger.NewItem(
                        record.key,
                        k,
                        record.line,
                        record.messages,
                        ids,
                        turn,
                        tools=record.tools,
                        chat_template_kwargs=merged,
                        metadata=record.metadata,
                        sampling_params=record.sampling_params,
                    )
                    for k in cycles.samples_of(record, options.samples_per_prompt)
                )
                continue
            new_items.extend(
                turns.chain_items(
                    record, ids, options.samples_per_prompt, chunk.plans.get(record.key), merged
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
                if not isinstance(entry, InputError):
                    entry = cycles.row_error(options.sampling, entry, spp) or entry
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
            fresh = cycles.expand_efforts(fresh, run.reasoning_efforts, spp)
            plans: dict[str, list[TurnPlan]] = {}
            turn_of: list[int] | None = None
            if options.turns == "all":  # template turn 0 now; later turns wait for it
                fresh = turns.first_turns(fresh, plans, fail)
            elif options.turns == "each":  # every boundary now, each on its original history
                fresh, turn_of = turns.boundary_records(fresh, fail)
            if renderer is None:
                ids = _submit(templater, fresh, kwargs)
            else:
                ids = Future()
                try:
                    ids.set_result(_render(renderer, fresh, kwargs))
                except RenderServerUnavailable as exc:
                    # what was templated before the outage is stored; nothing from this chunk on
                    while in_flight:
                        store_next()
                    if pending is not None:
                        pending.result()
                        pending = None
                    raise _stopped(db, run.id, report, chunk[0].line, exc) from exc
            in_flight.append(_Chunk(fresh, plans, report.lines, ids, turn_of))
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
        _publish_pending(db, run.id, publish, published_after, report, group_size)
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


def _stopped(
    db: Engine,
    run_id: int,
    report: EnqueueReport,
    first_line: int | None,
    exc: RenderServerUnavailable,
) -> RenderServerUnavailable:
    """The enqueue stops: recorded as an event, and said so that a rerun completes it."""
    message = (
        f"enqueue of run {report.run} stopped: {exc}. {report.inserted} items were stored; "
        f"nothing from line {first_line} on was. Run the same enqueue again to complete the "
        "run (stored prompts are skipped, none is duplicated)."
    )
    with db.begin() as conn:
        ledger.record_event(
            conn,
            EVENT_ENQUEUE_STOPPED,
            message,
            run_id=run_id,
            details={k: v for k, v in report.to_json().items() if k != "errors"},
        )
    log.error(message)
    return RenderServerUnavailable(message)


def _maybe_analyze(conn: Any, inserted: int, analyzed_at: int) -> int:
    """Refresh planner statistics each time the run has doubled (at least 20,000 rows)."""
    if inserted >= max(20_000, 2 * analyzed_at):
        ledger.refresh_statistics(conn)
        return inserted
    return analyzed_at


def _publish_pending(
    db: Engine,
    run_id: int,
    publish: Publish,
    after_id: int,
    report: EnqueueReport,
    batch_size: int | None = None,
) -> int:
    """Publish every still-pending item of the run (new ones, and ones a crash left behind).
    With batch_size (`--turns each`), publish is called once per message: the items of one
    conversation (one key) together, so that they run on one server."""
    if batch_size is not None:
        return _publish_groups(db, run_id, publish, after_id, report, batch_size)
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


def pack(groups: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """Messages of whole groups: consecutive groups share a message up to size ids, and a
    group larger than size is a message of its own (its items must reach one server)."""
    messages: list[list[int]] = []
    current: list[int] = []
    for group in groups:
        if current and len(current) + len(group) > size:
            messages.append(current)
            current = []
        current.extend(group)
    if current:
        messages.append(current)
    return messages


def _publish_groups(
    db: Engine, run_id: int, publish: Publish, after_id: int, report: EnqueueReport, size: int
) -> int:
    while True:
        with db.connect() as conn:
            rows = ledger.pending_keys(conn, run_id, after_id=after_id)
        if not rows:
            return after_id
        groups = [[i for i, _ in g] for _, g in itertools.groupby(rows, key=lambda r: r[1])]
        if len(rows) == PENDING_PAGE and len(groups) > 1:
            groups.pop()  # may go on in the next page: published with the rest of it
        for message in pack(groups, size):
            publish(message)
            with db.begin() as conn:
                ledger.mark_queued(conn, message)
            report.published += len(message)
        after_id = groups[-1][-1]
