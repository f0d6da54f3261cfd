"""The object-storage commands: `compact`, `archive`, and the Parquet path of `export`.

Thin: settings and the ledger in, workers.control.compaction / app.outputs.parquet_export do the
work, counts out.
"""

from __future__ import annotations

import click

from ops.options import counted, err_console, get_settings, handle_errors, open_db, print_json


def export_to_storage(
    run_name: str,
    out: str,
    weight_version: str | None = None,
    allow_mixed: bool = False,
    with_images: bool = False,
) -> None:
    """`tokenmill export RUN --format parquet --out URL`: shards and .manifest.json under URL."""
    from rich.markup import escape

    from app.ledger import run_queries
    from app.outputs.parquet_export import export_parquet
    from app.storage.image_store import image_location
    from app.storage.shards import StorageError

    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
    try:
        report = export_parquet(
            db,
            run,
            out,
            storage_options=settings.storage_options,
            shard_rows=settings.shard_rows,
            weight_version=weight_version,
            allow_mixed_weights=allow_mixed,
            image_store=image_location(settings, run.storage_url),
            with_images=with_images,
        )
    except OSError as exc:  # fsspec/s3fs report storage failures as OSError subclasses
        raise StorageError(f"writing the export to {out} failed: {exc}") from exc
    removed = f"; removed {counted(len(report.removed), 'old shard')}" if report.removed else ""
    if with_images:
        removed += f"; copied {counted(report.images, 'image')} to images/"
    err_console().print(
        f"wrote {counted(report.rows, 'sample')} ({report.truncated} truncated, "
        f"{counted(report.tokens, 'token')}) in {counted(len(report.shards), 'Parquet shard')} "
        f"and .manifest.json to {escape(report.url)}{removed}"
    )


@click.command("compact")
@click.argument("run_name")
@click.option(
    "--all",
    "force",
    is_flag=True,
    help="Compact every finished item, even fewer than TOKENMILL_COMPACT_MIN_ITEMS.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def compact_cmd(run_name: str, force: bool, as_json: bool) -> None:
    """Move RUN_NAME's finished token arrays from the ledger to Parquet shards in storage.

    Shards go under TOKENMILL_STORAGE_URL/runs/RUN_NAME/compacted/ (TOKENMILL_SHARD_ROWS rows
    each); export, verify and report read them transparently. Safe to interrupt and rerun.
    """
    from rich.markup import escape

    from app.ledger import run_queries
    from app.storage.shards import StorageError
    from workers.control.compaction import compact_run

    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
    try:
        report = compact_run(db, settings, run, force=force)
    except OSError as exc:
        raise StorageError(
            f"compaction into {settings.resolved_storage_url()} failed: {exc}"
        ) from exc
    if as_json:
        print_json(report.to_json())
        return
    line = (
        f"run [bold]{escape(run.name)}[/bold]: {counted(report.compacted, 'item')} compacted "
        f"into {counted(len(report.shards), 'shard')}"
    )
    if report.orphans_removed:
        line += f", {counted(len(report.orphans_removed), 'unreferenced shard')} removed"
    if report.skipped:
        line += f" ({escape(report.skipped)})"
    err_console().print(line, markup=True, soft_wrap=True)


@click.command("archive")
@click.argument("run_name")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def archive_cmd(run_name: str, as_json: bool) -> None:
    """Move finished RUN_NAME's items out of the ledger's hot table into items_archive.

    Compacts what is left first (as `compact --all`); refused while the run has unfinished
    items. Export, verify and report read an archived run as before; enqueueing into it is
    refused. Safe to interrupt and rerun.
    """
    from rich.markup import escape

    from app.core.errors import ArchiveRefused
    from app.ledger import archive, run_queries
    from app.storage.shards import StorageError
    from workers.control.compaction import compact_run

    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        blockers = archive.archive_blockers(conn, run.id)
    if blockers and not any("compact" in b for b in blockers):
        raise ArchiveRefused(f"run {run.name!r} cannot be archived: " + "; ".join(blockers))
    try:
        compacted = compact_run(db, settings, run, force=True)
    except OSError as exc:
        raise StorageError(
            f"compaction into {settings.resolved_storage_url()} failed: {exc}"
        ) from exc
    report = archive.archive_run(db, settings, run)
    if as_json:
        print_json({**report.to_json(), "compacted": compacted.compacted})
        return
    line = (
        f"run [bold]{escape(run.name)}[/bold]: {compacted.compacted} items compacted, "
        f"{report.deleted} items moved to the archive"
    )
    if report.skipped:
        line += f" ({escape(report.skipped)})"
    err_console().print(line, markup=True, soft_wrap=True)
