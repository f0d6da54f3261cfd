"""The pipeline commands: enqueue, reconcile (run: ops/run_cmd.py; export: export_cmd.py; status:
status_cmd).

Thin: parse options, call workers/app functions, show progress and counts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from app.core import constants
from app.core.errors import (
    BrokerUnavailable,
    ConfigurationError,
    InputError,
    NotFound,
    RunMismatch,
    TokenizerError,
)
from app.core.run_kinds import TurnsMode
from ops.options import (
    announce_embedded,
    broker_name,
    build_efforts,
    build_sampling,
    check_broker,
    counted,
    err_console,
    field_option,
    get_settings,
    handle_errors,
    ledger_name,
    open_db,
    print_json,
    priority_option,
    render_options,
    sampling_options,
)

if TYPE_CHECKING:
    from app.core.settings import Settings
    from app.ledger import run_queries
    from app.prompts.tokenization import ChatTokenizer
    from workers.intake.producer import EnqueueOptions, EnqueueReport

MAX_ERRORS_SHOWN = 50


def _template_choice(
    opts: dict[str, Any], existing: run_queries.RunInfo | None
) -> tuple[Any, bool]:
    """The template choice and --pass-turn-fields of the command line; a later enqueue that
    gives none of them keeps the run's."""
    from app.prompts.chat_pins import choice_of
    from app.prompts.template_choice import TemplateChoice

    given = TemplateChoice(opts.get("chat_template_name"), opts.get("chat_template_file"))
    passing = bool(opts.get("pass_turn_fields"))
    if existing is not None and given == TemplateChoice() and not passing:
        return choice_of(existing.generation.chat_pins)
    return given, passing


def enqueue_input(
    input_path: Path,
    run: str,
    tokenizer_path: str,
    publish: bool,
    opts: dict[str, Any],
    *,
    driver: str | None = None,
) -> EnqueueReport:
    """Enqueue INPUT_PATH into run (publishing its items when publish); driver: who serves it
    (run_queries.DRIVER_RUN for `tokenmill run`; None: the fleet)."""
    from app.prompts.inputs import check_input

    check_input(input_path)  # at once, before the heavy imports and the tokenizer
    from app.prompts.inputs import parse_chat_template_kwargs
    from workers.intake.producer import EnqueueOptions

    settings = get_settings()
    _check_destinations(settings, publish=publish, fleet=driver is None)
    db = open_db(settings)
    kwargs = parse_chat_template_kwargs(opts["chat_template_kwargs"])
    existing = _existing_run(db, run)
    servers = _bound_servers(db, opts.get("servers") or ())
    if existing is not None:
        _check_pinned_files(existing, tokenizer_path)
    # a run created with --trust-remote-code keeps it: a later enqueue need not repeat it
    trusted = opts["trust_remote_code"] or (
        existing is not None and existing.generation.trust_remote_code
    )
    tokenizer = _run_tokenizer(tokenizer_path, opts, existing, trusted=trusted)
    contexts = opts.get("server_contexts")
    if contexts is None and driver is None:  # the fleet's: its registered servers' own
        contexts = _fleet_contexts(db, settings, servers)
    context_length = _context_length(contexts or {}, tokenizer.context_length)
    options = EnqueueOptions(
        input_path=input_path,
        run=run,
        sampling=build_sampling(opts),
        samples_per_prompt=opts["samples_per_prompt"],
        chat_template_kwargs=kwargs,
        prompt_field=opts.get("prompt_field"),
        turns=TurnsMode(opts.get("turns", TurnsMode.LAST)),
        tool_call_parser=opts.get("tool_call_parser"),
        parallel_calls=opts.get("parallel_calls") or constants.PARALLEL_CALLS_END,
        trust_remote_code=trusted,
        render_with=_render_url(opts.get("render_with")),
        require_parity=bool(opts.get("require_parity")),
        batch_size=settings.batch_size,
        weight_version=opts.get("weight_version"),
        reasoning_efforts=build_efforts(opts),
        image_root=opts.get("image_root"),
        servers=servers,
        driver=driver,
        priority=opts.get("priority"),
        context_length=context_length,
        request_fields=not opts.get("no_request_fields"),
    )
    # the messages carry the run's priority (a later enqueue's is the run's own)
    priority = _run_priority(options.priority, existing)
    publisher = _publisher(options, settings, priority) if publish else None
    report = _enqueue_with_progress(db, tokenizer, options, publisher, settings)
    _print_enqueue_report(report, db, options, settings, published=publish)
    return report


def _check_destinations(settings: Settings, *, publish: bool, fleet: bool) -> None:
    """Before anything is read or written: a broker URL with a known scheme (when publishing)
    and, for a fleet's run, storage the fleet reaches."""
    if publish:
        check_broker(settings)  # a typo of the scheme, before anything is inserted
        announce_embedded(settings, broker=True)
    if fleet:
        from app.storage import run_store

        run_store.check_fleet_storage(settings, run_store.pinned_url(settings))


def _run_tokenizer(
    tokenizer_path: str,
    opts: dict[str, Any],
    existing: run_queries.RunInfo | None,
    *,
    trusted: bool,
) -> ChatTokenizer:
    """The tokenizer of --tokenizer with the run's template choice (an existing run's pinned
    one unless the options name another)."""
    from app.prompts.tokenization import load_tokenizer

    template, pass_turn_fields = _template_choice(opts, existing)
    try:
        return load_tokenizer(
            tokenizer_path,
            trust_remote_code=trusted,
            template=template,
            pass_turn_fields=pass_turn_fields,
            # the server renders: a folder without a chat template (DeepSeek-V3.2) is no error
            server_renders=opts.get("render_with") is not None,
        )
    except TokenizerError as exc:
        raise TokenizerError(f"--tokenizer: {exc}") from exc


def _context_length(contexts: dict[str, int | None], tokenizer_context: int | None) -> int | None:
    """The context length prompts are held to (the servers' own, else the model folder's),
    saying so when they differ."""
    from rich.markup import escape

    from app.sglang.limits import choose_context

    context = choose_context(contexts, tokenizer_context)
    if context.notice:
        err_console().print(
            f"[yellow]{escape(context.notice)}[/yellow]", markup=True, soft_wrap=True
        )
    return context.context_length


def _publisher(
    options: EnqueueOptions, settings: Settings, priority: int
) -> Callable[[list[int]], None]:
    """What hands the producer's new ids to the broker, a message per batch at the run's
    priority."""
    from workers.intake.publish import publish_items

    # `--turns each`: the producer hands over one message's ids at a time (a conversation's
    # items stay in one message, even past batch_size)
    whole = options.turns.boundary_samples

    def publisher(ids: list[int]) -> None:
        size = max(settings.batch_size, len(ids)) if whole else settings.batch_size
        publish_items(ids, batch_size=size, run=options.run, priority=priority)

    return publisher


class _SkippedLines:
    """Prints each skipped line as the producer reports it, the first MAX_ERRORS_SHOWN only."""

    def __init__(self, input_path: Path) -> None:
        self.input_path = input_path
        self.shown = 0

    def __call__(self, error: InputError) -> None:
        from rich.markup import escape

        console = err_console()
        self.shown += 1
        if self.shown <= MAX_ERRORS_SHOWN:
            console.print(
                f"[yellow]skipped[/yellow] {escape(str(self.input_path))} {escape(str(error))}",
                markup=True,
                soft_wrap=True,
            )
        elif self.shown == MAX_ERRORS_SHOWN + 1:
            console.print("[yellow]… more skipped lines; see the counts below[/yellow]")


def _enqueue_with_progress(
    db: Any,
    tokenizer: ChatTokenizer,
    options: EnqueueOptions,
    publisher: Callable[[list[int]], None] | None,
    settings: Settings,
) -> EnqueueReport:
    """The producer's enqueue under a progress bar (on a terminal only)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from app.sglang.render import render_client
    from workers.intake.producer import enqueue

    console = err_console()
    input_path = options.input_path
    total_bytes = input_path.stat().st_size if input_path.is_file() else 0
    with Progress(
        TextColumn("enqueue"),
        BarColumn(),
        TextColumn("{task.fields[lines]} lines"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,  # a bar in a log file is only noise
    ) as progress:
        task = progress.add_task("enqueue", total=total_bytes or None, lines=0)
        renderer = render_client(options.render_with, settings) if options.render_with else None
        try:
            return enqueue(
                db,
                tokenizer,
                options,
                publish=publisher,
                renderer=renderer,
                on_error=_SkippedLines(input_path),
                on_progress=lambda n: progress.update(task, lines=n),
            )
        except Exception as exc:
            raise unpublished_error(exc, db, options.run, settings) from exc
        finally:
            if renderer is not None:
                renderer.close()


def _print_enqueue_report(
    report: EnqueueReport, db: Any, options: EnqueueOptions, settings: Settings, *, published: bool
) -> None:
    """What the enqueue did: counts, images, where the items went, which fields did what."""
    from rich.markup import escape

    console = err_console()
    run = options.run
    console.print(
        f"run [bold]{escape(run)}[/bold]: {report.prompts} prompts read, {report.inserted} "
        f"items inserted, {report.published} published, {report.already_present} prompts "
        f"already present, {report.skipped} {_unit(report)}s skipped",
        markup=True,
        soft_wrap=True,
    )
    if report.images_read:
        console.print(
            f"{report.images_read} distinct image sources read, each once "
            f"({report.image_bytes_read:,} bytes), "
            f"stored under {escape(_storage_of(db, run, settings))}/images",
            markup=True,
            soft_wrap=True,
        )
    if report.images_refused:
        console.print(
            f"{report.images_refused} image sources could not be used, nothing stored for them "
            "(their rows are skipped, each named above)",
            markup=False,
            soft_wrap=True,
        )
    where = f"ledger {ledger_name(settings)}"
    if published:
        where += f", broker {broker_name(settings)}"
    console.print(f"into {escape(where)}", markup=True, soft_wrap=True)
    for title, fields in (
        ("prompts built from", report.prompt_fields),
        ("item keys from", report.key_fields),
        ("kept as row metadata (exported with each sample)", report.metadata_fields),
        (
            "not applied (SGLang's chat completions render the same prompt without them)",
            report.not_applied_fields,
        ),
    ):
        if fields:
            counts = ", ".join(
                f"{escape(name)} ({counted(n, 'row')})" for name, n in fields.items()
            )
            console.print(f"fields {title}: {counts}", markup=True, soft_wrap=True)


def unpublished_error(exc: Exception, db: Any, run: str, settings: Settings) -> Exception:
    """exc, or for a broker that failed mid-enqueue, the error that also says how many items
    wait in the ledger unpublished and how to queue them."""
    import sys

    if "kombu" not in sys.modules:
        return exc
    from kombu.exceptions import OperationalError

    if not isinstance(exc, OperationalError):
        return exc
    from app.ledger import reads

    waiting = 0
    info = _existing_run(db, run)
    if info is not None:
        with db.connect() as conn:
            waiting = reads.run_counts(conn, info).pending
    return BrokerUnavailable(
        f"the broker {broker_name(settings)} failed: {str(exc).strip().splitlines()[0]}; "
        f"{waiting} items of run {run} are in the ledger but not queued: "
        f"`tokenmill reconcile {run}` queues them once the broker answers"
    )


def _run_priority(given: int | None, existing: run_queries.RunInfo | None) -> int:
    """The priority the run's messages carry: --priority, else the existing run's, else 0."""
    if given is not None:
        return given
    return existing.priority if existing is not None else 0


def _render_url(url: str | None) -> str | None:
    if url is None:
        return None
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"--render-with: {url!r} is not an http(s) URL")
    return url.rstrip("/")


def _fleet_contexts(
    db: Any, settings: Settings, bound: tuple[str, ...] | None
) -> dict[str, int | None]:
    """The context length of each server the run may use (the --servers bound, else every
    registered one), from its /server_info."""
    from app.ledger import registry
    from workers.engine.server_limits import server_contexts

    with db.connect() as conn:
        known = registry.list_servers(conn)
    urls = {s.name: s.url for s in known if bound is None or s.name in bound}
    return server_contexts(settings, urls)


def _bound_servers(db: Any, given: tuple[str, ...]) -> tuple[str, ...] | None:
    """`--servers`: the names given (repeated or comma-separated), each a registered server;
    None when none is given (any server of the fleet)."""
    from app.ledger import registry

    names = [n.strip() for value in given for n in value.split(",") if n.strip()]
    if not names:
        return None
    with db.connect() as conn:
        known = [s.name for s in registry.list_servers(conn)]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise click.BadParameter(
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not registered "
            f"(registered: {', '.join(known) or 'none'}; `tokenmill servers` lists them)",
            param_hint="--servers",
        )
    return tuple(dict.fromkeys(names))


def _storage_of(db: Any, run: str, settings: Settings) -> str:
    """The storage URL the run pinned (a run older than the pin: TOKENMILL_STORAGE_URL)."""
    existing = _existing_run(db, run)
    return (existing.storage_url if existing else None) or settings.resolved_storage_url()


def _existing_run(db: Any, run: str) -> run_queries.RunInfo | None:
    from app.ledger import run_queries

    with db.connect() as conn:
        try:
            return run_queries.get_run(conn, run)
        except NotFound:
            return None


def pinned_folder_changes(run: run_queries.RunInfo, tokenizer_path: str | None = None) -> list[str]:
    """How the tokenizer folder (the run's own unless given) differs from the files the run
    pinned, read before any of its code runs."""
    from app.prompts.tokenizer_files import folder_changes

    folder = Path(tokenizer_path or run.generation.tokenizer_path)
    return folder_changes(folder, run.generation.tokenizer_hash, run.generation.tokenizer_files)


def _check_pinned_files(run: run_queries.RunInfo, tokenizer_path: str) -> None:
    """Refuse a tokenizer folder whose files differ from the run's before any of its code runs,
    naming each changed, new or removed file."""
    changes = pinned_folder_changes(run, tokenizer_path)
    if changes:
        raise RunMismatch(
            f"run {run.name!r} already exists with other tokenizer files; use a new --run name "
            "or the original files. Differences: " + "; ".join(changes)
        )


def _unit(report: EnqueueReport) -> str:
    """The unit of the skipped entries: "row" for a Parquet/datasets input, else "line"."""
    return report.errors[0].unit if report.errors else "line"


@click.command("enqueue")
@click.argument("input_path", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Run name (created on first enqueue).")
@click.option(
    "--tokenizer",
    "tokenizer_path",
    required=True,
    help="Local tokenizer folder: its chat template renders the prompts (without one, "
    "--render-with renders them on the server).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--servers",
    "servers",
    multiple=True,
    metavar="NAME[,NAME...]",
    help="Only these registered servers serve the run (repeat or comma-separate; pinned by "
    "the run; `tokenmill status` shows it); without it, any server of the fleet does.",
)
@field_option
@sampling_options
@render_options
@priority_option
@handle_errors
def enqueue_cmd(
    input_path: Path, run_name: str, tokenizer_path: str, as_json: bool, **opts: Any
) -> None:
    """Read INPUT_PATH, tokenize with the chat template, record and queue the items.

    INPUT_PATH is a JSONL(.gz) file, a .parquet file or folder of them, or a folder written
    by datasets' save_to_disk.
    """
    report = enqueue_input(input_path, run_name, tokenizer_path, True, opts)
    if as_json:
        print_json(report.to_json())


@click.command("reconcile")
@click.argument("run_name", required=False)
@handle_errors
def reconcile_cmd(run_name: str | None) -> None:
    """Re-queue items whose lease expired or that were never published."""
    settings = get_settings()
    check_broker(settings)  # before the Celery app (publish_items) is built on the URL
    announce_embedded(settings, broker=True)
    db = open_db(settings)
    from workers.control.reconcile import reconcile
    from workers.intake.publish import publish_by_priority

    def publish(ids: list[int], wait_s: float) -> None:  # each with its run's priority
        publish_by_priority(db, ids, batch_size=settings.batch_size, countdown_s=wait_s)

    report = reconcile(db, settings, run=run_name, publish=publish)
    print_json(report.to_json())
