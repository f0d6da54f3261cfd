"""The pipeline commands: enqueue, run, export, reconcile (status: ops/status_cmd.py).

Thin: parse options, call workers/app functions, show progress and counts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click

from app.core.constants import EXPORT_FORMATS
from app.core.errors import ConfigurationError, InputError, NotFound, RunMismatch, TokenizerError
from ops.options import (
    build_efforts,
    build_sampling,
    err_console,
    field_option,
    get_settings,
    handle_errors,
    open_db,
    print_json,
    render_options,
    sampling_options,
)

if TYPE_CHECKING:
    from rich.table import Table

    from app.ledger import RunCounts, RunInfo
    from app.outputs.export import ExportFormat
    from app.prompts.tokenization import ChatTokenizer
    from workers.engine.runner import EmbeddedRunner
    from workers.intake.producer import EnqueueReport

MAX_ERRORS_SHOWN = 50


def _enqueue(
    input_path: Path, run: str, tokenizer_path: str, publish: bool, opts: dict[str, Any]
) -> EnqueueReport:
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from app.prompts.inputs import parse_chat_template_kwargs
    from app.prompts.render import render_client
    from app.prompts.tokenization import load_tokenizer
    from workers.intake.producer import EnqueueOptions, enqueue

    console = err_console()
    settings = get_settings()
    db = open_db(settings)
    kwargs = parse_chat_template_kwargs(opts["chat_template_kwargs"])
    existing = _existing_run(db, run)
    if existing is not None:
        _check_pinned_files(existing, tokenizer_path)
    # a run created with --trust-remote-code keeps it: a later enqueue need not repeat it
    trusted = opts["trust_remote_code"] or (existing is not None and existing.trust_remote_code)
    try:
        tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trusted)
    except TokenizerError as exc:
        raise TokenizerError(f"--tokenizer: {exc}") from exc
    options = EnqueueOptions(
        input_path=input_path,
        run=run,
        sampling=build_sampling(opts),
        samples_per_prompt=opts["samples_per_prompt"],
        chat_template_kwargs=kwargs,
        prompt_field=opts.get("prompt_field"),
        turns=opts.get("turns", "last"),
        trust_remote_code=trusted,
        render_with=_render_url(opts.get("render_with")),
        require_parity=bool(opts.get("require_parity")),
        batch_size=settings.batch_size,
        weight_version=opts.get("weight_version"),
        reasoning_efforts=build_efforts(opts),
    )
    publisher = None
    if publish:
        from workers.intake.publish import publish_items

        # `--turns each`: the producer hands over one message's ids at a time (a conversation's
        # items stay in one message, even past batch_size)
        whole = options.turns == "each"

        def publisher(ids: list[int]) -> None:
            size = max(settings.batch_size, len(ids)) if whole else settings.batch_size
            publish_items(ids, batch_size=size, run=run)

    shown = 0

    def on_error(error: InputError) -> None:
        nonlocal shown
        shown += 1
        if shown <= MAX_ERRORS_SHOWN:
            console.print(
                f"[yellow]skipped[/yellow] {escape(str(input_path))} {escape(str(error))}",
                markup=True,
                soft_wrap=True,
            )
        elif shown == MAX_ERRORS_SHOWN + 1:
            console.print("[yellow]… more skipped lines; see the counts below[/yellow]")

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
            report = enqueue(
                db,
                tokenizer,
                options,
                publish=publisher,
                renderer=renderer,
                on_error=on_error,
                on_progress=lambda n: progress.update(task, lines=n),
            )
        finally:
            if renderer is not None:
                renderer.close()
    console.print(
        f"run [bold]{escape(run)}[/bold]: {report.prompts} prompts read, {report.inserted} "
        f"items inserted, {report.published} published, {report.already_present} prompts "
        f"already present, {report.skipped} {_unit(report)}s skipped",
        markup=True,
        soft_wrap=True,
    )
    for title, fields in (
        ("prompts built from", report.prompt_fields),
        ("kept as row metadata (exported with each sample)", report.metadata_fields),
    ):
        if fields:
            counts = ", ".join(f"{escape(name)} ({n} rows)" for name, n in fields.items())
            console.print(f"fields {title}: {counts}", markup=True, soft_wrap=True)
    return report


def _render_url(url: str | None) -> str | None:
    if url is None:
        return None
    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"--render-with: {url!r} is not an http(s) URL")
    return url.rstrip("/")


def _existing_run(db: Any, run: str) -> RunInfo | None:
    from app import ledger

    with db.connect() as conn:
        try:
            return ledger.get_run(conn, run)
        except NotFound:
            return None


def pinned_folder_changes(run: RunInfo, tokenizer_path: str | None = None) -> list[str]:
    """How the tokenizer folder (the run's own unless given) differs from the files the run
    pinned, read before any of its code runs."""
    from app.prompts.tokenizer_files import folder_changes

    folder = Path(tokenizer_path or run.tokenizer_path)
    return folder_changes(folder, run.tokenizer_hash, run.tokenizer_files)


def _check_pinned_files(run: RunInfo, tokenizer_path: str) -> None:
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
    help="Local tokenizer folder with a chat template.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@field_option
@sampling_options
@render_options
@handle_errors
def enqueue_cmd(
    input_path: Path, run_name: str, tokenizer_path: str, as_json: bool, **opts: Any
) -> None:
    """Read INPUT_PATH, tokenize with the chat template, record and queue the items.

    INPUT_PATH is a JSONL(.gz) file, a .parquet file or folder of them, or a folder written
    by datasets' save_to_disk.
    """
    report = _enqueue(input_path, run_name, tokenizer_path, True, opts)
    if as_json:
        print_json(report.to_json())


def _progress_table(counts: RunCounts, runner: EmbeddedRunner, started: float) -> Table:
    from rich.markup import escape
    from rich.table import Table

    elapsed = max(time.monotonic() - started, 1e-6)
    finished = counts.done + counts.failed
    rate = counts.output_tokens / elapsed
    items_rate = finished / elapsed
    eta = (counts.total - finished) / items_rate if items_rate > 0 else float("nan")
    table = Table.grid(padding=(0, 2))
    width = 30
    filled = int(width * finished / counts.total) if counts.total else width
    bar = "█" * filled + "░" * (width - filled)
    table.add_row(
        f"[bold]{escape(counts.run)}[/bold]",
        bar,
        f"{finished}/{counts.total}",
        f"done {counts.done}",
        f"failed {counts.failed}",
        f"truncated {counts.truncated}",
        f"{rate:,.0f} tok/s",
        f"ETA {eta:,.0f}s" if eta == eta else "ETA —",
    )
    for view in runner.servers():
        state = (
            "[red]fingerprint differs: no work[/red]"
            if view.refused
            else "[red]unavailable[/red]"
            if view.unavailable
            else "[green]ok[/green]"
        )
        if view.parity_differs:
            state += " [yellow]renders prompts differently[/yellow]"
        err = f"last error: {escape(view.last_error[:80])}" if view.last_error else ""
        table.add_row(
            f"  {escape(view.name)}",
            state,
            f"in flight {view.inflight}",
            f"done {view.done}",
            f"failed {view.failed}",
            "",
            "",
            err,
        )
    return table


@click.command("run")
@click.argument("input_path", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Run name.")
@click.option("--tokenizer", "tokenizer_path", required=True, help="Local tokenizer folder.")
@click.option(
    "--server",
    "servers",
    multiple=True,
    required=True,
    help="SGLang server URL; repeat for several servers.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the final counts as JSON.")
@field_option
@sampling_options
@render_options
@handle_errors
def run_cmd(
    input_path: Path,
    run_name: str,
    tokenizer_path: str,
    servers: tuple[str, ...],
    as_json: bool,
    **opts: Any,
) -> None:
    """Enqueue INPUT_PATH and generate it in this process against --server URLs until done."""
    counts = run_pipeline(input_path, run_name, tokenizer_path, list(servers), opts)
    if as_json:
        print_json(counts.to_json())


def run_pipeline(
    input_path: Path, run_name: str, tokenizer_path: str, servers: list[str], opts: dict[str, Any]
) -> RunCounts:
    from rich.live import Live
    from rich.markup import escape

    from app import ledger
    from workers.engine.runner import EmbeddedRunner

    console = err_console()
    settings = get_settings()
    db = open_db(settings)
    _enqueue(input_path, run_name, tokenizer_path, False, opts)
    with db.connect() as conn:
        run = ledger.get_run(conn, run_name)
    runner = EmbeddedRunner(db, settings, run, servers)
    started = time.monotonic()
    runner.start()
    try:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            counts = runner.wait(on_tick=lambda c: live.update(_progress_table(c, runner, started)))
    finally:
        runner.stop()
    console.print(
        f"run [bold]{escape(run_name)}[/bold] finished in {time.monotonic() - started:.1f}s: "
        f"{counts.done} done ({counts.truncated} truncated), {counts.failed} failed, "
        f"{counts.output_tokens} output tokens",
        markup=True,
    )
    return counts


@click.command("export")
@click.argument("run_name")
@click.option(
    "--format",
    "fmt",
    type=click.Choice((*EXPORT_FORMATS, "parquet")),
    default="specforge",
    show_default=True,
)
@click.option(
    "--out",
    required=True,
    help="A JSONL file; for parquet a folder URL (local path, file://, s3://...), where the "
    "shards and .manifest.json go (options from TOKENMILL_STORAGE_OPTIONS).",
)
@click.option(
    "--per-turn",
    is_flag=True,
    help="A --turns all run: one row per regenerated turn (the specforge default; what "
    "SpecForge recommends for Kimi).",
)
@click.option(
    "--whole-conversation",
    is_flag=True,
    help="A --turns all run: one row per conversation whose every turn is done; specforge "
    "masks every regenerated assistant turn (the conversations default).",
)
@click.option(
    "--weight-version",
    default=None,
    metavar="V",
    help="Export only the samples made with this weight_version.",
)
@click.option(
    "--allow-mixed-weights",
    is_flag=True,
    help="Export samples of several weight versions together (refused otherwise).",
)
@handle_errors
def export_cmd(
    run_name: str,
    fmt: str,
    out: str,
    per_turn: bool,
    whole_conversation: bool,
    weight_version: str | None,
    allow_mixed_weights: bool,
) -> None:
    """Write RUN_NAME's finished samples to --out: JSONL, or Parquet shards + .manifest.json.
    Every sample carries its weight_version and sampling_params; one weight version per export
    unless --allow-mixed-weights."""
    if fmt == "parquet":
        from ops.storage_cmds import export_to_storage

        export_to_storage(run_name, out, weight_version, allow_mixed_weights)
        return
    from rich.markup import escape

    from app import ledger
    from app.outputs.export import export_run
    from app.prompts.tokenization import load_tokenizer

    console = err_console()
    db = open_db()
    with db.connect() as conn:
        run = ledger.get_run(conn, run_name)
    tokenizer: ChatTokenizer | None = None
    if whole_conversation or fmt == "conversations":
        # the run's pinned --trust-remote-code covers the code it was made with, not changed code
        changes = pinned_folder_changes(run)
        if changes and run.trust_remote_code:
            raise RunMismatch(
                f"the tokenizer files at {run.tokenizer_path} changed since run {run.name} "
                f"pinned them, so their code is not run: {'; '.join(changes)}"
            )
        tokenizer = load_tokenizer(run.tokenizer_path, trust_remote_code=run.trust_remote_code)
        if whole_conversation and tokenizer.chat_template_hash != run.chat_template_hash:
            # the loss mask spans come from the run's own template
            raise ConfigurationError(
                f"the chat template at {run.tokenizer_path} differs from the one run "
                f"{run.name} pinned; --whole-conversation needs the run's own template"
            )
        if changes:
            console.print(
                f"[yellow]warning:[/yellow] the tokenizer at {escape(run.tokenizer_path)} "
                f"changed since the run was created: {escape('; '.join(changes))}",
                markup=True,
                soft_wrap=True,
            )
    report = export_run(
        db,
        run,
        cast("ExportFormat", fmt),
        Path(out),
        tokenizer=tokenizer,
        per_turn=per_turn,
        whole_conversation=whole_conversation,
        weight_version=weight_version,
        allow_mixed_weights=allow_mixed_weights,
    )
    console.print(
        f"wrote {report.rows} samples ({report.truncated} truncated, "
        f"{report.tokens} tokens) to {escape(str(report.path))}"
    )


@click.command("reconcile")
@click.argument("run_name", required=False)
@handle_errors
def reconcile_cmd(run_name: str | None) -> None:
    """Re-queue items whose lease expired or that were never published."""
    from workers.control.reconcile import reconcile
    from workers.intake.publish import publish_items

    settings = get_settings()
    db = open_db(settings)

    def publish(ids: list[int], wait_s: float) -> None:
        if ids:
            publish_items(ids, batch_size=settings.batch_size, countdown_s=wait_s)

    report = reconcile(db, settings, run=run_name, publish=publish)
    print_json(report.to_json())
