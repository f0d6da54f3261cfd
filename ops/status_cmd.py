"""`tokenmill status`: counts per run from the item counters, the servers whose rendering
differs, enqueues that stopped early; `--watch` for the live dashboard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ops.options import err_console, get_settings, handle_errors, ledger_name, open_db, print_json
from ops.views.text_table import Column, left_out_note, render

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from app.ledger import reads, registry, run_queries


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
    from app.ledger import reads, registry, retries, run_queries

    db = open_db()
    if watch:
        if as_json:
            raise click.UsageError("--watch is for a terminal; use --json without it")
        from ops.views.dashboard import watch as watch_dashboard

        watch_dashboard(db, run_name=run_name, interval_s=interval_s, console=err_console())
        return
    with db.connect() as conn:
        runs = [run_queries.get_run(conn, run_name)] if run_name else run_queries.list_runs(conn)
        counts = [reads.run_counts(conn, r) for r in runs]
        servers = registry.list_servers(conn)
        differing = _differing_servers(servers)
        stopped = registry.stopped_enqueues(conn, [r.id for r in runs])
        unserved = _unserved_images(conn, servers, runs, counts)
        # read for the runs that have failed items only (their counters say so)
        failed = {
            r.name: retries.failed_by_reason(conn, r.id)
            for r, c in zip(runs, counts, strict=True)
            if c.failed
        }
        endings = {
            r.name: reads.chain_endings(conn, r.id) for r in runs if r.generation.turns.chains
        }
    stopped_names = {r.name for r in runs if r.id in stopped}
    if not runs and not as_json:
        # an empty table would not say where it looked (a forgotten TOKENMILL_DATABASE_URL)
        click.echo(f"no runs in the ledger {ledger_name(get_settings())}", err=True)
        return
    if as_json:
        found = [
            c.to_json()
            | {
                "rendering_differs": differing.get(c.run, []),
                "enqueue_stopped": c.run in stopped_names,
                "served_by": _served_by(r),
                "failed_by_reason": dict(failed.get(c.run, [])),
                "chain_endings": endings.get(c.run, {}),
            }
            for c, r in zip(counts, runs, strict=True)
        ]
        print_json(found[0] if run_name else found)
        return
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
    for r in runs:  # the binding of runs not open to the whole fleet
        if not r.fleet_run or r.servers is not None:
            click.echo(f"run {r.name}: served by {r.binding()}")
    for name, reasons in failed.items():
        click.echo("\n".join(failure_lines(name, reasons)))
    for name, ended in endings.items():
        if ended:
            shown = ", ".join(f"{n} {reason}" for reason, n in ended.items())
            click.echo(f"run {name}: agentic chains ended: {shown}")
    if stopped_names or any(differing.get(c.run) for c in counts):
        _print_warnings(counts, stopped_names, differing)
    for name in unserved:
        from rich.markup import escape

        err_console().print(
            f"[yellow]run {escape(name)}: its image items wait[/yellow]: no registered server "
            "understands images (their /model_info has_image_understanding is not true)",
            markup=True,
            soft_wrap=True,
        )


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


def _unserved_images(
    conn: Connection,
    servers: list[registry.ServerInfo],
    runs: list[run_queries.RunInfo],
    counts: list[reads.RunCounts],
) -> list[str]:
    """The runs with image items to claim while every registered server whose fingerprint is
    known understands no images (such servers never take them); none when one does."""
    from app.ledger.claims import image_items_left

    known = [s.fingerprint for s in servers if s.fingerprint]
    if not known or any("images" in fingerprint for fingerprint in known):
        return []
    waiting = {c.run for c in counts if c.pending or c.queued}
    return [r.name for r in runs if r.name in waiting and image_items_left(conn, r.id)]


def _print_warnings(
    counts: list[reads.RunCounts], stopped_names: set[str], differing: dict[str, list[str]]
) -> None:
    """Runs whose last enqueue stopped early and servers that render a run differently."""
    from rich.markup import escape

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
