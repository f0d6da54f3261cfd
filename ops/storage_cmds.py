"""The object-storage commands: `compact`, and the Parquet path of `export`.

Thin: settings and the ledger in, workers.compaction / app.storage do the work, counts out.
"""

from __future__ import annotations

import click
from rich.markup import escape

from app import ledger
from app.settings import get_settings
from app.shards import StorageError
from app.storage import export_parquet
from ops.options import console, handle_errors, open_db, print_json
from workers.compaction import compact_run


def export_to_storage(run_name: str, out: str) -> None:
    """`tokenmill export RUN --format parquet --out URL`: shards and .manifest.json under URL."""
    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = ledger.get_run(conn, run_name)
    try:
        report = export_parquet(
            db,
            run,
            out,
            storage_options=settings.storage_options,
            shard_rows=settings.shard_rows,
        )
    except OSError as exc:  # fsspec/s3fs report storage failures as OSError subclasses
        raise StorageError(f"writing the export to {out} failed: {exc}") from exc
    removed = f"; removed {len(report.removed)} old shards" if report.removed else ""
    console.print(
        f"wrote {report.rows} samples ({report.truncated} truncated, {report.tokens} tokens) "
        f"in {len(report.shards)} Parquet shards and .manifest.json to {escape(report.url)}"
        f"{removed}"
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
    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = ledger.get_run(conn, run_name)
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
        f"run [bold]{escape(run.name)}[/bold]: {report.compacted} items compacted into "
        f"{len(report.shards)} shards"
    )
    if report.orphans_removed:
        line += f", {len(report.orphans_removed)} unreferenced shards removed"
    if report.skipped:
        line += f" ({escape(report.skipped)})"
    console.print(line, markup=True, soft_wrap=True)
