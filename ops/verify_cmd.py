"""The `verify` command: re-check a run's stored items (and optionally its export).

Exit 0 when everything matches, 1 on any mismatch or finding, 2 on usage/configuration errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import click

from app.core.errors import TokenizerError
from ops.options import counted, get_settings, handle_errors, open_db, print_json

if TYPE_CHECKING:
    from rich.console import Console

    from app.core.settings import Settings
    from app.ledger import reads, run_queries
    from app.outputs.verify import CheckTally, ExportSummary, Rerender, VerifyReport
    from app.prompts.tokenization import ChatTokenizer


@click.command("verify")
@click.argument("run_name", required=False)
@click.option(
    "--export",
    "export_url",
    default=None,
    metavar="URL",
    help="Also check the export at URL against the ledger: a Parquet folder (a path, "
    "file://, s3://...: counts, checksums, rows, image references) or a .jsonl export (its "
    "image references); storage options from TOKENMILL_STORAGE_OPTIONS.",
)
@click.option(
    "--tokenizer",
    "tokenizer_path",
    default=None,
    metavar="DIR",
    help="Tokenizer folder to re-apply the template with, if the run's pinned path moved "
    "(its hashes are still checked against the pinned ones).",
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    default=False,
    help="Allow the --tokenizer folder's own Python code (a run created with "
    "--trust-remote-code allows it already).",
)
@click.option(
    "--counts",
    is_flag=True,
    default=False,
    help="Instead, check the item counters (what status, servers and /metrics show) against "
    "a full count of the items of RUN_NAME, or of every run.",
)
@click.option(
    "--repair",
    is_flag=True,
    default=False,
    help="With --counts: replace counters that drifted by the full count (writers wait).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def verify_cmd(
    run_name: str | None,
    export_url: str | None,
    tokenizer_path: str | None,
    trust_remote_code: bool,
    counts: bool,
    repair: bool,
    as_json: bool,
) -> None:
    """Check RUN_NAME's finished items against what the run pinned.

    The chat template re-applied to the stored turns gives the stored prompt_ids; stopped
    outputs end with a stop/EOS id; truncated ones have exactly max_new_tokens ids; the
    stored arrays match the server's prompt_tokens / completion_tokens. Image items: their
    image_token_counts rebuild the served prompt, and every stored image still hashes to
    its sha256. Failed items make the run not clean, counted by reason. Exit 0 when clean,
    1 on any mismatch or failed item, 2 on usage errors.

    With --counts: the item counters equal a full count (exit 0), or they drifted (exit 1;
    exit 0 once --repair has replaced them).
    """
    if repair and not counts:
        raise click.UsageError("--repair goes with --counts")
    if counts:
        _verify_counts(run_name, repair=repair, as_json=as_json)
        return
    if run_name is None:
        raise click.UsageError("missing argument RUN_NAME")
    from app.ledger import run_queries
    from app.outputs.verify import verify_run
    from app.storage.image_store import image_location

    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
    tokenizer, problem = _tokenizer(run, tokenizer_path, trust_remote_code)
    with _server_rerender(run, settings) as rerender:
        report = verify_run(
            db,
            run,
            tokenizer,
            export_url=export_url,
            storage_options=settings.storage_options,
            image_store=image_location(settings, run.storage_url),
            rerender=rerender,
        )
    if problem is not None:
        report.findings.insert(0, problem)
    if as_json:
        print_json(report.to_json())
    else:
        _print_summary(report)
    raise SystemExit(0 if report.clean else 1)


@contextlib.contextmanager
def _server_rerender(run: run_queries.RunInfo, settings: Settings) -> Iterator[Rerender | None]:
    """For a run whose folder has no chat template (its server renders), the re-render of
    stored items by the run's render server, as parity sends them; else None."""
    from app.prompts.chat_pins import rendered_on_server

    if run.generation.render_with is None or not rendered_on_server(run.generation.chat_pins):
        yield None
        return
    from app.core.errors import InputError, PermanentError
    from app.sglang.render import RenderRequest, render_client
    from app.storage.image_store import image_location
    from workers.control.parity import item_request
    from workers.intake.images import StoredImages

    images = StoredImages(lambda: image_location(settings))
    with render_client(run.generation.render_with, settings) as client:

        def rerender(items: Sequence[reads.StoredItem]) -> list[list[int] | str]:
            requests: list[RenderRequest | str] = []
            for item in items:
                try:
                    requests.append(item_request(item, run, images))
                except InputError as exc:
                    requests.append(exc.reason)
            answers = iter(client.render_many([r for r in requests if not isinstance(r, str)]))
            out: list[list[int] | str] = []
            for request in requests:
                if isinstance(request, str):
                    out.append(request)
                    continue
                ids = next(answers)
                out.append(
                    f"the render server refused it: {ids}"
                    if isinstance(ids, PermanentError)
                    else ids
                )
            return out

        yield rerender


def _verify_counts(run_name: str | None, *, repair: bool, as_json: bool) -> None:
    from rich.console import Console
    from rich.markup import escape

    from app.ledger import counters, run_queries

    out = Console(highlight=False, soft_wrap=True)
    db = open_db()
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run_name).id if run_name is not None else None
    drift = counters.check(db, run_id, repair_drift=repair)
    scope = f"run {run_name}" if run_name is not None else "every run"
    if as_json:
        print_json(
            {
                "scope": scope,
                "drift": [d.describe() for d in drift],
                "repaired": bool(drift) and repair,
            }
        )
    else:
        for d in drift:
            out.print(f"[red]drift:[/red] {escape(d.describe())}", soft_wrap=True)
        if not drift:
            out.print(f"item counters of {escape(scope)}: [green]equal to a full count[/green]")
        elif repair:
            out.print(f"item counters of {escape(scope)}: replaced by a full count")
        else:
            out.print(
                f"item counters of {escape(scope)}: [red]{len(drift)} keys drifted[/red]; "
                "`tokenmill verify --counts --repair` replaces them by a full count"
            )
    raise SystemExit(1 if drift and not repair else 0)


def _tokenizer(
    run: run_queries.RunInfo, override: str | None, trust_remote_code: bool
) -> tuple[ChatTokenizer | None, str | None]:
    """The tokenizer to re-apply the template with; the run's own path not loading is a
    finding (nothing can vouch for the prompts), a bad --tokenizer a usage error. The run's
    pinned --trust-remote-code holds for both."""
    from app.prompts.tokenization import load_for_run
    from ops.pipeline_cmd import pinned_folder_changes

    explicit = trust_remote_code
    trust_remote_code = trust_remote_code or run.generation.trust_remote_code
    if override is not None:
        try:
            return load_for_run(
                override, trust_remote_code=trust_remote_code, chat_pins=run.generation.chat_pins
            ), None
        except TokenizerError as exc:
            raise TokenizerError(f"--tokenizer: {exc}") from exc
    # the run's pin trusts the code the run was made with, not whatever the folder holds now:
    # changed files are a finding and are not loaded (an explicit --trust-remote-code loads them)
    changes = pinned_folder_changes(run) if not explicit else []
    if changes and run.generation.trust_remote_code:
        return None, (
            f"the tokenizer files at {run.generation.tokenizer_path} changed since the run "
            "pinned them, so "
            f"their code was not run and the chat template was not checked: {'; '.join(changes)}"
            "; pass --trust-remote-code to check with them anyway, or --tokenizer DIR"
        )
    try:
        return load_for_run(
            run.generation.tokenizer_path,
            trust_remote_code=trust_remote_code,
            chat_pins=run.generation.chat_pins,
        ), None
    except TokenizerError as exc:
        return None, (
            f"the run's tokenizer could not be loaded, so the chat template was not checked: "
            f"{exc}; give its folder with --tokenizer DIR"
        )


def _only_failures(report: VerifyReport) -> bool:
    """The run is not clean for its failed items alone (what it finished is clean)."""
    exported_ok = report.export is None or not report.export.problems
    mismatched = any(t.mismatches for t in report.checks.values())
    return exported_ok and not report.findings and not mismatched


def _print_summary(report: VerifyReport) -> None:
    from rich.console import Console
    from rich.markup import escape

    # the summary is the command's output: stdout (errors go to stderr through handle_errors)
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"run [bold]{escape(report.run)}[/bold]: {report.items} finished items")
    for finding in report.findings:
        out.print(f"[red]finding:[/red] {escape(finding)}", soft_wrap=True)
    _print_failed(out, report)
    for tally in report.checks.values():
        _print_check(out, tally)
    if report.export is not None:
        _print_export(out, report.export)
    out.print(_verdict(report))


def _print_failed(out: Console, report: VerifyReport) -> None:
    """The run's failed items by reason, and the command that retries them."""
    from rich.markup import escape

    if not report.failed:
        return
    out.print(
        f"[red]FAIL[/red] {'failed':<18} {report.failed_items} items failed, by reason "
        f"(`tokenmill retry {escape(report.run)}` re-queues them):",
        soft_wrap=True,
    )
    width = len(str(report.failed[0][1]))
    for reason, n in report.failed:
        out.print(f"       {n:>{width}}  {escape(reason)}", soft_wrap=True)


def _print_check(out: Console, tally: CheckTally) -> None:
    """One check's line (checked, mismatched, not checkable) and its example mismatches; an
    image check only for a run with images."""
    from rich.markup import escape

    from app.outputs.verify import CHECK_TITLES, IMAGE_CHECKS

    if tally.name in IMAGE_CHECKS and not (tally.checked or tally.not_checkable):
        return  # a run without images
    status = "[red]FAIL[/red]" if tally.mismatches else "[green]ok[/green]  "
    counts = f"{tally.checked} checked"
    if tally.mismatches:
        counts += f", {tally.mismatches} mismatched"
    if tally.not_checkable:
        counts += f", {tally.not_checkable} not checkable"
    out.print(
        f"{status} {tally.name:<18} {counts:<40} {escape(CHECK_TITLES[tally.name])}",
        soft_wrap=True,
    )
    for m in tally.examples:
        out.print(
            f"       item {m.item_id} (id {escape(repr(m.key))}, sample {m.sample}, "
            f"turn {m.turn}): {escape(m.detail)}",
            soft_wrap=True,
        )
    if tally.mismatches > len(tally.examples):
        out.print(f"       … and {tally.mismatches - len(tally.examples)} more")


def _print_export(out: Console, export: ExportSummary) -> None:
    """The export's line (its shards and rows) and each problem found in it."""
    from rich.markup import escape

    from app.outputs.jsonl_checks import is_jsonl_export

    status = "[red]FAIL[/red]" if export.problems else "[green]ok[/green]  "
    shards = "" if is_jsonl_export(export.url) else f"{counted(export.shards, 'shard')}, "
    out.print(
        f"{status} export {escape(export.url)}: {shards}{counted(export.rows, 'row')}",
        soft_wrap=True,
    )
    for problem in export.problems:
        out.print(f"       {escape(problem)}", soft_wrap=True)


def _verdict(report: VerifyReport) -> str:
    if report.clean:
        return "[green]clean[/green]"
    if report.failed and report.failed_items and _only_failures(report):
        return "[red]not clean: failed items[/red]"
    return "[red]mismatches found[/red]"
