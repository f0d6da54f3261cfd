"""`tokenmill status`: counts per run from the item counters, the servers whose rendering
differs, enqueues that stopped early; `--watch` for the live dashboard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ops.options import (
    err_console,
    get_settings,
    handle_errors,
    ledger_name,
    open_db,
    print_json,
    print_table,
)

if TYPE_CHECKING:
    from app.ledger import registry


@click.command("status")
@click.argument("run_name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--watch", is_flag=True, help="A live dashboard of runs, servers and events.")
@click.option(
    "--interval-s",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between --watch refreshes.",
)
@handle_errors
def status_cmd(run_name: str | None, as_json: bool, watch: bool, interval_s: float) -> None:
    """Counts per run (all runs, or RUN_NAME); --watch for a live dashboard until Ctrl-C."""
    from app import ledger
    from app.ledger import registry

    db = open_db()
    if watch:
        if as_json:
            raise click.UsageError("--watch is for a terminal; use --json without it")
        from ops.dashboard import watch as watch_dashboard

        watch_dashboard(db, run_name=run_name, interval_s=interval_s, console=err_console())
        return
    with db.connect() as conn:
        runs = [ledger.get_run(conn, run_name)] if run_name else ledger.list_runs(conn)
        counts = [ledger.run_counts(conn, r) for r in runs]
        differing = _differing_servers(registry.list_servers(conn))
        stopped = registry.stopped_enqueues(conn, [r.id for r in runs])
    stopped_names = {r.name for r in runs if r.id in stopped}
    if not runs and not as_json:
        # an empty table would not say where it looked (a forgotten TOKENMILL_DATABASE_URL)
        err_console().print(
            f"no runs in the ledger {ledger_name(get_settings())}", markup=False, soft_wrap=True
        )
        return
    if as_json:
        found = [
            c.to_json()
            | {
                "rendering_differs": differing.get(c.run, []),
                "enqueue_stopped": c.run in stopped_names,
            }
            for c in counts
        ]
        print_json(found[0] if run_name else found)
        return
    # the waiting column (later turns of `--turns all` runs) only when some run has any
    fields = [
        (name, attr)
        for name, attr in STATUS_COLUMNS
        if attr != "waiting" or any(c.waiting for c in counts)
    ]
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    rows = [[str(getattr(c, attr)) for _, attr in fields] for c in counts]
    # names and numbers are never cut: each column is at least as wide as its longest value
    # (headers wrap instead), and the light box leaves room for the columns in 80
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("run", no_wrap=True, min_width=max((len(c.run) for c in counts), default=3))
    for i, (name, _) in enumerate(fields):
        widest = max((len(r[i]) for r in rows), default=1)
        # short headers keep their width; "out tokens" may wrap onto two lines
        table.add_column(name, justify="right", min_width=max(widest, min(len(name), 6)))
    for c, row in zip(counts, rows, strict=True):
        table.add_row(escape(c.run), *row)
    print_table(table)
    console = err_console()
    for c in counts:
        if c.run in stopped_names:
            console.print(
                f"[red]run {escape(c.run)}: its last enqueue stopped before the end of the input"
                "[/red] (see `tokenmill events`); run the same enqueue again to complete it",
                markup=True,
                soft_wrap=True,
            )
        for server in differing.get(c.run, []):
            console.print(
                f"[yellow]run {escape(c.run)}: server {escape(server)} renders its prompts "
                f"differently[/yellow] (tokenmill parity {escape(c.run)} --server "
                f"{escape(server)})",
                markup=True,
                soft_wrap=True,
            )


def _differing_servers(servers: list[registry.ServerInfo]) -> dict[str, list[str]]:
    """Run name → the servers whose last parity check of it found a difference."""
    out: dict[str, list[str]] = {}
    for server in servers:
        for run in server.differing_runs():
            out.setdefault(run, []).append(server.name)
    return out


STATUS_COLUMNS = (
    ("total", "total"),
    ("wait", "waiting"),
    ("pend", "pending"),
    ("queued", "queued"),
    ("leased", "leased"),
    ("done", "done"),
    ("failed", "failed"),
    ("trunc", "truncated"),
    ("out tokens", "output_tokens"),
)
