"""`tokenmill status`: counts per run from the item counters, the servers whose rendering
differs, enqueues that stopped early; `--watch` for the live dashboard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ops.options import err_console, get_settings, handle_errors, ledger_name, open_db, print_json
from ops.views.text_table import Column, left_out_note, render

if TYPE_CHECKING:
    from app.ledger import reads, run_queries, status_reads


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
    """Counts per run (all runs, or RUN_NAME); --watch for a live dashboard until Ctrl-C.

    Names and numbers are never cut: in a narrow terminal the columns queued, leased, pend,
    wait, trunc and out tokens are left out, in that order (--json has every count).
    """
    from app.ledger import status_reads

    db = open_db()
    if watch:
        if as_json:
            raise click.UsageError("--watch is for a terminal; use --json without it")
        from ops.views.dashboard import watch as watch_dashboard

        watch_dashboard(db, run_name=run_name, interval_s=interval_s, console=err_console())
        return
    with db.connect() as conn:
        status = status_reads.read_status(conn, run_name)
    if as_json:
        found = _status_json(status)
        print_json(found[0] if run_name else found)
    elif not status.runs:
        # an empty table would not say where it looked (a forgotten TOKENMILL_DATABASE_URL)
        click.echo(f"no runs in the ledger {ledger_name(get_settings())}", err=True)
    else:
        _print_table(status.counts)
        _print_notes(status)
        _print_warnings(status)


def _status_json(status: status_reads.RunsStatus) -> list[dict[str, Any]]:
    """Each run's counts and what the table says beside them, for --json."""
    return [
        c.to_json()
        | {
            "rendering_differs": status.differing.get(c.run, []),
            "enqueue_stopped": c.run in status.stopped,
            "served_by": _served_by(r),
            # servers whose workers do not serve the run (its pinned fingerprint or limits), why
            "not_served_by": status.not_served.get(c.run, {}),
            "priority": r.priority,
            "failed_by_reason": dict(status.failed.get(c.run, [])),
            "chain_endings": status.endings.get(c.run, {}),
        }
        for c, r in zip(status.counts, status.runs, strict=True)
    ]


def _print_table(counts: list[reads.RunCounts]) -> None:
    """The counts per run, fitted to the terminal (a note on stderr names what was left out)."""
    # the waiting column (later turns of `--turns all` runs) only when some run has any
    fields = [
        (column, attr)
        for column, attr in STATUS_COLUMNS
        if attr != "waiting" or any(c.waiting for c in counts)
    ]
    rows = [[c.run, *(str(getattr(c, attr)) for _, attr in fields)] for c in counts]
    lines, dropped = render([RUN_COLUMN, *(column for column, _ in fields)], rows)
    click.echo("\n".join(lines))
    note = left_out_note(dropped)
    if note:
        click.echo(note, err=True)


def _print_notes(status: status_reads.RunsStatus) -> None:
    """Below the table: the binding of runs not open to the whole fleet (while they have work
    left; a finished run's is in --json), priorities other than the default, failures by reason
    and how agentic chains ended."""
    for r, c in zip(status.runs, status.counts, strict=True):
        if (not r.fleet_run or r.servers is not None) and not c.finished:
            click.echo(f"run {r.name}: served by {r.binding()}")
    for r in status.runs:  # the priority of runs that have one (0 is every run's by default)
        if r.priority:
            click.echo(f"run {r.name}: priority {r.priority} (higher first)")
    for name, reasons in status.failed.items():
        click.echo("\n".join(failure_lines(name, reasons)))
    for name, ended in status.endings.items():
        if ended:
            shown = ", ".join(f"{n} {reason}" for reason, n in ended.items())
            click.echo(f"run {name}: agentic chains ended: {shown}")


def _served_by(run: run_queries.RunInfo) -> dict[str, Any]:
    """Who serves the run, for --json: the fleet (any server, or the --servers it is bound
    to) or the `tokenmill run` that drives it."""
    return {"driver": "fleet" if run.fleet_run else "run", "servers": run.servers}


def failure_lines(run: str, reasons: list[tuple[str, int]], *, shown: int = 10) -> list[str]:
    """A run's failed items by reason, the most common first, and the command that retries
    them."""
    total = sum(n for _, n in reasons)
    width = len(str(max((n for _, n in reasons), default=0)))
    lines = [f"run {run}: {total} failed, by reason (`tokenmill retry {run}` re-queues them):"]
    lines += [f"  {n:>{width}}  {reason}" for reason, n in reasons[:shown]]
    if len(reasons) > shown:
        rest = sum(n for _, n in reasons[shown:])
        lines.append(f"  {rest:>{width}}  ({len(reasons) - shown} more reasons)")
    return lines


def _print_warnings(status: status_reads.RunsStatus) -> None:
    """On stderr: runs whose last enqueue stopped early, servers that render a run differently
    or do not serve it (and why), and runs whose image items no registered server takes."""
    from rich.markup import escape

    console = err_console()
    for c in status.counts:
        if c.run in status.stopped:
            console.print(
                f"[red]run {escape(c.run)}: its last enqueue stopped before the end of the input"
                "[/red] (see `tokenmill events`); run the same enqueue again to complete it",
                markup=True,
                soft_wrap=True,
            )
        for server in status.differing.get(c.run, []):
            console.print(
                f"[yellow]run {escape(c.run)}: server {escape(server)} renders its prompts "
                f"differently[/yellow] (tokenmill parity {escape(c.run)} --server "
                f"{escape(server)})",
                markup=True,
                soft_wrap=True,
            )
    for name, servers in status.not_served.items():
        for server, why in sorted(servers.items()):
            console.print(
                f"[yellow]run {escape(name)}: server {escape(server)} does not serve it"
                f"[/yellow]: {escape(why)} (`tokenmill servers`, `tokenmill events`)",
                markup=True,
                soft_wrap=True,
            )
    for name in status.unserved:
        console.print(
            f"[yellow]run {escape(name)}: its image items wait[/yellow]: no registered server "
            "understands images (their /model_info has_image_understanding is not true)",
            markup=True,
            soft_wrap=True,
        )


# Names and numbers are never cut. A table wider than the terminal folds "out tokens", then
# leaves out queued, leased, pending, waiting, truncated and out tokens, in that order; run,
# total, done and failed always stay (a table still too wide is printed whole).
RUN_COLUMN = Column("run")
STATUS_COLUMNS = (
    (Column("total", right=True), "total"),
    (Column("wait", right=True, drop=4), "waiting"),
    (Column("pend", right=True, drop=3), "pending"),
    (Column("queued", right=True, drop=1), "queued"),
    (Column("leased", right=True, drop=2), "leased"),
    (Column("done", right=True), "done"),
    (Column("failed", right=True), "failed"),
    (Column("trunc", right=True, drop=5), "truncated"),
    (Column("out tokens", right=True, drop=6), "output_tokens"),
)
