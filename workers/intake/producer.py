"""The producer: an enqueue as a pipeline of named stages, read → plan turns → template or render
→ build items → store → publish → report, each stage a unit of its own (reading.py, prompting.py,
storing.py, reporting.py beside this module).

A bad line is reported with its number and skipped; a rerun inserts and publishes nothing
new; each chunk is one transaction, so nothing half-written is left behind.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from app.core import constants
from app.core.constants import EVENT_RUN_CREATED
from app.core.contracts import SamplingParams
from app.core.errors import InputError
from app.core.images import ImagePins
from app.core.run_kinds import RunKind, TurnsMode
from app.core.settings import Settings, get_settings
from app.ledger import event_log, image_tokens, queue, removal, run_queries
from app.prompts import request_fields, tool_calls
from app.prompts.chat_path import check_version
from app.prompts.chat_pins import run_pins, with_server_render
from app.prompts.image_pins import check_run_pins
from app.prompts.template_pool import Templater
from app.prompts.tokenization import ChatTokenizer, check_template_kwargs
from app.sglang.render import RenderClient, RenderServerUnavailable
from app.storage import run_store
from app.storage.image_store import image_location
from app.storage.shards import Location
from workers.intake import cycles
from workers.intake.images import ImageResolver, ImageSources, StoredImages
from workers.intake.prompting import (
    ItemBuilder,
    LocalTemplating,
    PromptedChunk,
    PromptSource,
    ServerRendering,
)
from workers.intake.reading import Planner, Reader
from workers.intake.reporting import EnqueueReport as EnqueueReport
from workers.intake.reporting import Reporter
from workers.intake.storing import Publish, Publisher, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnqueueOptions:
    input_path: Path
    run: str
    sampling: SamplingParams
    samples_per_prompt: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # the field (column) holding the prompt, instead of the JSONL field names
    prompt_field: str | None = None
    # "all": one item per assistant turn, chained (workers/chains/); "each": one independent
    # item per assistant turn on the original history (boundary samples); pinned by the run
    turns: TurnsMode = TurnsMode.LAST
    # `--tool-call-parser`: how "all" reads the target's calls on rows with tool turns (None:
    # SGLang's template detection); pinned by the run as chat_pins["tool_call_parser"]
    tool_call_parser: str | None = None
    # `--parallel-calls`: "end" (a turn of parallel calls ends its chain) or "in-order" (it goes
    # on when the calls match the dataset's one by one); pinned as chat_pins["parallel_calls"]
    # when "in-order"
    parallel_calls: str = constants.PARALLEL_CALLS_END
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
    # the rows' tool_choice applied as SGLang applies it; False (`--no-request-fields`): kept
    # as metadata only, rendered as if absent (pinned)
    request_fields: bool = True
    # `--image-root PATH`: where relative image paths of the rows are read from (None: the
    # input file's folder)
    image_root: Path | None = None
    # `--servers NAME...`: only these registered servers serve the run (pinned)
    servers: tuple[str, ...] | None = None
    # run_queries.DRIVER_RUN: `tokenmill run` drives the run, the fleet leaves it alone
    driver: str | None = None
    # `--priority N`: higher first (pinned; None: 0 for a new run, a later enqueue keeps it)
    priority: int | None = None
    # the context length prompts are held to: the servers' own when `tokenmill run` read it
    # from their /server_info (app.sglang.limits), else None: the tokenizer folder's
    context_length: int | None = None
    # what the run's items are for (its policy: workers/engine/policies.py); pinned by the run
    kind: RunKind = RunKind.GENERATE

    def __post_init__(self) -> None:
        # the CLI's string form ("last", "all", "each") reads typed
        object.__setattr__(self, "turns", TurnsMode(self.turns))


def run_spec(
    tokenizer: ChatTokenizer,
    options: EnqueueOptions,
    storage_url: str | None = None,
    server_render: str | None = None,
) -> run_queries.RunSpec:
    """What the run pins: the tokenizer and its template, the sampling, the turns mode, where
    its images are stored, which servers serve it; server_render: the sha256 of the render
    server's answers to its probe (`--render-with`)."""
    pins = run_pins(tokenizer, rendered_here=options.render_with is None)
    if server_render is not None:
        pins = with_server_render(pins, server_render)
    # the fields applied, by name: a run created when fewer were applied is not mixed with them
    pins["request_fields"] = list(request_fields.APPLIED) if options.request_fields else []
    if options.turns.chains:
        vocab = tokenizer.hf_tokenizer.get_vocab()
        pins["tool_call_parser"] = tool_calls.choose_parser(
            options.tool_call_parser, vocab, tokenizer.template.text
        )
        if options.parallel_calls == constants.PARALLEL_CALLS_IN_ORDER:
            pins["parallel_calls"] = options.parallel_calls
    return run_queries.RunSpec(
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
        chat_pins=pins,
        weight_version=options.weight_version,
        reasoning_efforts=options.reasoning_efforts,
        storage_url=storage_url,
        servers=options.servers,
        driver=options.driver,
        kind=options.kind,
        priority=options.priority,
    )


def checked_spec(
    tokenizer: ChatTokenizer,
    options: EnqueueOptions,
    renderer: RenderClient | None,
    storage_url: str | None = None,
) -> run_queries.RunSpec:
    """run_spec, with the render server's render pinned (`--render-with`); a TokenizerError
    for what needs a local template the folder lacks."""
    if (renderer is None) != (options.render_with is None):
        raise ValueError("a renderer is given exactly when options.render_with is set")
    if options.turns.chains:
        # the next turn's history holds the answer split into reasoning and content
        tokenizer.require_local_template(
            "--turns all (each answer becomes the next turn's history)"
        )
    server_render = None if renderer is None else renderer.probe_sha256()
    return run_spec(tokenizer, options, storage_url, server_render)


def open_run(
    db: Engine,
    spec: run_queries.RunSpec,
    report: EnqueueReport,
    image_pins: ImagePins | None = None,
) -> run_queries.RunInfo:
    """The run, created (and its creation recorded) if new; an existing run must match spec,
    be pinned to chat-path rules this tokenmill has and to the tokenizer's image placeholder."""
    with db.begin() as conn:
        run, created = run_queries.get_or_create_run(conn, spec)
        # later enqueues build prompts with the rules the run pinned (or are refused)
        check_version(run.generation.normalization_version, run=run.name)
        if not created:
            check_run_pins(image_tokens.run_image_pins(conn, run.id), image_pins, run.name)
        report.run_created = created
        if created:
            event_log.record_event(
                conn,
                EVENT_RUN_CREATED,
                f"run {run.name} created: tokenizer {spec.tokenizer_path}, "
                f"sampling {spec.sampling.to_json()}",
                run_id=run.id,
            )
    return run


def image_resolver(
    options: EnqueueOptions, settings: Settings, run: run_queries.RunInfo
) -> ImageResolver:
    """The image stage: the run's pinned store (opened at the first image, which records the
    run's marker there for workers to find), relative paths read from `--image-root`, else
    from the input file's folder."""

    def open_store() -> Location:
        loc = image_location(settings, run.storage_url)
        run_store.write_marker(loc, run.id, run.name)
        return loc

    return ImageResolver(
        ImageSources(
            open_store,
            options.image_root or Path(options.input_path).resolve().parent,
            settings.storage_options,
        )
    )


def stored_images(settings: Settings, run: run_queries.RunInfo) -> StoredImages:
    """The run's stored images as `--render-with` sends them (its pinned storage)."""
    return StoredImages(lambda: image_location(settings, run.storage_url))


def plan_stage(
    db: Engine,
    run: run_queries.RunInfo,
    options: EnqueueOptions,
    reporter: Reporter,
    settings: Settings,
) -> Planner:
    """The plan stage of an enqueue into run (a new run holds no key yet)."""

    def existing_keys(keys: Any) -> set[str]:
        with db.connect() as conn:
            return queue.existing_keys(conn, run.id, keys)

    return Planner(
        options.turns,
        existing_keys=None if reporter.report.run_created else existing_keys,
        reporter=reporter,
        efforts=run.generation.reasoning_efforts,
        tool_call_parser=run.generation.tool_call_parser,
        samples_per_prompt=options.samples_per_prompt,
        images=image_resolver(options, settings, run),
    )


def enqueue(
    db: Engine,
    tokenizer: ChatTokenizer,
    options: EnqueueOptions,
    *,
    publish: Publish | None,
    renderer: RenderClient | None = None,
    on_error: Callable[[InputError], None] = lambda e: None,
    on_progress: Callable[[int], None] = lambda n: None,
    settings: Settings | None = None,
) -> EnqueueReport:
    """Stream options.input_path into the ledger; publish new ids when publish is given.

    settings: where the image store is (default: the configured settings), so a caller with
    its own (the demo) stores images where its workers read them."""
    report = EnqueueReport(run=options.run)
    # Read the first line before writing anything: a file that is missing, unreadable or
    # empty is refused with no run created.
    check_template_kwargs(options.chat_template_kwargs)
    reader = Reader(
        options.input_path,
        prompt_field=options.prompt_field,
        content_format=tokenizer.content_format,
        pass_turn_fields=tokenizer.pass_turn_fields,
        turns=options.turns,
        reorders_tool_results=tokenizer.reorders_tool_results,
        renders_every_tool=renderer is not None and tokenizer.renders_every_tool,
        request_fields=options.request_fields,
        # a row's own sampling_params must be what SGLang takes for each of its samples
        row_check=lambda record: cycles.row_error(
            options.sampling, record, options.samples_per_prompt
        ),
    )
    settings = settings or get_settings()
    spec = checked_spec(tokenizer, options, renderer, run_store.pinned_url(settings))
    reporter = Reporter(report, unit=reader.unit, on_error=on_error, on_progress=on_progress)
    run = open_run(db, spec, report, tokenizer.image_pins)
    kwargs = options.chat_template_kwargs

    planner = plan_stage(db, run, options, reporter, settings)
    publisher = (
        None
        if publish is None
        else Publisher(
            db,
            run.id,
            publish,
            reporter,
            group_size=options.batch_size if run.generation.turns.boundary_samples else None,
        )
    )
    templater = Templater(tokenizer, options.template_processes)
    store = Store(
        db,
        run.id,
        link_chains=run.generation.turns.chains,
        publisher=publisher,
        reporter=reporter,
        image_pins=tokenizer.image_pins,
        run_name=run.name,
    )
    pipeline = EnqueuePipeline(
        reader,
        planner,
        LocalTemplating(templater, kwargs)
        if renderer is None
        else ServerRendering(renderer, kwargs, stored_images(settings, run)),
        ItemBuilder(
            run_kwargs=kwargs,
            samples_per_prompt=options.samples_per_prompt,
            context_length=options.context_length or tokenizer.context_length,
            reporter=reporter,
            image_pins=tokenizer.image_pins,
            no_pins=tokenizer.no_image_pins,
            chat_pins=run.generation.chat_pins if run.generation.turns.chains else None,
        ),
        store,
        reporter,
        # chunks templated ahead: one per templating process, plus one being stored
        ahead=templater.processes,
    )
    try:
        try:
            pipeline.run(db, run.id)
        finally:
            templater.close()
            store.close()  # the last chunk's write done (or failed) before the run is judged
    except Exception as exc:
        note = left_behind(db, run, report, exc)
        if note is not None:
            exc.add_note(note)  # the command's error line ends with it
        raise
    if publisher is not None:
        publisher.publish_pending()
    if report.inserted == 0 and report.already_present == 0:
        raise nothing_usable(db, run, report, options.input_path, reader.unit)
    return reporter.finished(db, run.id)


def nothing_usable(
    db: Engine, run: run_queries.RunInfo, report: EnqueueReport, path: Path, unit: str
) -> InputError:
    """The error of an input with no usable prompt (a binary file, say); a run this enqueue
    created is deleted again, so nothing is left behind that holds no work."""
    first = f"; the first: {report.errors[0]}" if report.errors else ""
    if report.run_created:
        _remove_created_run(db, run)
        outcome = f"run {run.name} was not created"
    else:
        outcome = f"run {run.name} is unchanged"
    return InputError(
        f"no prompt of {str(path)!r} could be used ({report.skipped} {unit}s skipped{first}); "
        f"{outcome}"
    )


def left_behind(
    db: Engine, run: run_queries.RunInfo, report: EnqueueReport, exc: Exception
) -> str | None:
    """What an enqueue that failed (storage, broker, a server) leaves of the run it created: a
    run that holds no item yet is deleted again (it would pin the storage that failed, and a
    second enqueue with the storage fixed starts afresh); one that holds items stays, said so
    with the way to go on or remove it. None for a run that existed before."""
    if not report.run_created:
        return None
    if report.inserted == 0:
        try:
            _remove_created_run(db, run)
        except Exception as removal_error:  # the ledger failed too: say what is left
            log.warning(
                "run %s: removing it failed: %s",
                run.name,
                removal_error,
                extra={"action": "enqueue_cleanup_failed"},
            )
            return f"run {run.name} was created empty: `tokenmill delete {run.name}` removes it"
        return f"run {run.name} was not created"
    if isinstance(exc, RenderServerUnavailable):
        return None  # its message says what was stored and how to complete the run
    return (
        f"run {run.name} was created and holds {report.inserted} items: the same enqueue again "
        f"completes it, `tokenmill delete {run.name}` removes it"
    )


def _remove_created_run(db: Engine, run: run_queries.RunInfo) -> None:
    """Delete the run this enqueue created and left empty (its events go with it)."""
    with db.begin() as conn:
        removal.delete_run_row(conn, run.id, run.name)


class EnqueuePipeline:
    """Drives the stages over the input. The chunks templated ahead wait in a queue bounded
    by `ahead`: the database work of a chunk overlaps the templating of the next ones, one
    chunk is stored at a time, so order is kept and memory stays bounded."""

    def __init__(
        self,
        reader: Reader,
        planner: Planner,
        prompts: PromptSource,
        builder: ItemBuilder,
        store: Store,
        reporter: Reporter,
        *,
        ahead: int,
    ) -> None:
        self._reader = reader
        self._planner = planner
        self._prompts = prompts
        self._builder = builder
        self._store = store
        self._reporter = reporter
        self._ahead = ahead
        self._templated: deque[PromptedChunk] = deque()

    def run(self, db: Engine, run_id: int) -> None:
        """Every chunk of the input through the stages, up to stored (and published)."""
        for chunk in self._reader.chunks(self._reporter):
            planned = self._planner.plan(chunk)
            try:
                prompted = self._prompts.start(planned)
            except RenderServerUnavailable as exc:
                # what was templated before the outage is stored; nothing from this chunk on
                self._drain()
                raise self._reporter.stopped(db, run_id, chunk.first_line, exc) from exc
            self._templated.append(prompted)
            if len(self._templated) > self._ahead:
                self._store_next()
        self._drain()

    def _store_next(self) -> None:
        chunk = self._templated.popleft()
        self._store.submit(self._builder.items(chunk), chunk.planned.lines)

    def _drain(self) -> None:
        while self._templated:
            self._store_next()
        self._store.flush()
