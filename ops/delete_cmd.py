"""`tokenmill delete RUN`: the run, its items, compacted shards and events leave the ledger
and storage; refused while work is in flight unless `--force`. Once the run has left the
ledger the command succeeds: shards the storage would not let go of are a warning.

Exports written with `tokenmill export` are the user's files and stay where they are.
"""

from __future__ import annotations

import click

from ops.options import (
    counted,
    err_console,
    first_line,
    get_settings,
    handle_errors,
    open_db,
    print_json,
)


@click.command("delete")
@click.argument("run_name")
@click.option(
    "--force",
    is_flag=True,
    help="Delete even while items are leased or queued (a worker's results for them are lost).",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was deleted as JSON.")
@handle_errors
def delete_cmd(run_name: str, force: bool, as_json: bool) -> None:
    """Delete RUN_NAME: its items (archived ones too), compacted shards, events and counters.

    Refused while items are leased or queued (a worker holds or may take them) unless
    --force. Safe to interrupt and rerun: items go in pages, the run itself last.
    """
    from rich.markup import escape

    from app.core.errors import ConfigurationError
    from app.ledger import reads, removal, run_queries
    from workers.control.compaction import remove_run_shards

    settings = get_settings()
    db = open_db(settings)
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        counts = reads.run_counts(conn, run)
    if (counts.leased or counts.queued) and not force:
        raise ConfigurationError(
            f"run {run.name!r} has work in flight ({counts.leased} items leased, "
            f"{counts.queued} queued): stop its workers or `tokenmill run` first, or pass "
            "--force to delete it anyway"
        )
    deleted = 0
    while True:
        with db.begin() as conn:
            page = removal.delete_items_page(conn, run.id)
        if not page:
            break
        deleted += page
    with db.begin() as conn:
        removal.delete_run_row(conn, run.id, run.name)
    folder = run.storage_url or settings.resolved_storage_url()
    try:
        shards = remove_run_shards(settings, run)
    except Exception as exc:  # the run is gone whatever the storage says: it is no failure
        left = f"its compacted shards under {folder} could not be removed ({first_line(exc)})"
        if as_json:
            print_json({"run": run.name, "items": deleted, "shards": None, "shards_left": left})
            return
        err_console().print(
            f"deleted run [bold]{escape(run.name)}[/bold]: {counted(deleted, 'item')} and its "
            "events; "
            f"[yellow]warning:[/yellow] {escape(left)}: remove them with the storage's own tools",
            markup=True,
            soft_wrap=True,
        )
        return
    if as_json:
        print_json({"run": run.name, "items": deleted, "shards": len(shards)})
        return
    err_console().print(
        f"deleted run [bold]{escape(run.name)}[/bold]: {counted(deleted, 'item')}, "
        f"{counted(len(shards), 'compacted shard')} and its events",
        markup=True,
        soft_wrap=True,
    )
