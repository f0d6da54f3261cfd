"""Operator commands for the server fleet: servers, pause, resume, restart, events.

Every change goes through the durable ledger flag plus Celery remote control, and lands in
the event timeline.
"""

from __future__ import annotations

import shlex
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from app.core.constants import PAUSED_BY_OPERATOR
from app.core.errors import ConfigurationError
from ops.options import (
    counted,
    err_console,
    get_settings,
    handle_errors,
    open_db,
    print_json,
    setting_option,
)
from ops.views.text_table import Column, count_states, left_out_note, render

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from app.ledger import registry, windows
    from ops.views.progress import Line, Progress
    from workers.control.restart import RestartProgress


# a load reading older than this is aged in `servers` (workers read it every
# TOKENMILL_AUTOSIZE_PROBE_S, 2 s, and write it every 5 s)
STALE_LOAD_S = 15.0


def _ago(at: datetime | None) -> str:
    from app.ledger import common

    if at is None:
        return "—"
    return _ago_s((common.utcnow() - at).total_seconds())


@click.group("servers", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="A JSON list of server objects.")
@click.pass_context
@handle_errors
def servers_group(ctx: click.Context, as_json: bool) -> None:
    """List the SGLang servers: URL (and the workers' own URL below it when it differs), state,
    pause, workers, leased items, window, last probe and error.

    leased: the items leased to the server's workers (being generated, or waiting in a worker's
    backlog for a free slot), so it may exceed the window. The window is the requests the
    server's workers keep in flight together: `auto: 272 requests (max_running 256)` (sized by
    the server) or `fixed: 64 requests` (TOKENMILL_INFLIGHT), and below it the server's running
    and queued requests at the workers' last reading (aged when stale: `read 40s ago`) and why
    the size last changed.

    Names and URLs are never cut: in a narrow terminal a column with nothing to say (every cell
    `—`) is left out first, then last probe, workers, leased, rendering, last error, weights,
    paused, window and not serving, in that order (--json has all).
    """
    if ctx.invoked_subcommand is not None:
        return
    from app.ledger import counters, registry, status_reads

    db = open_db()
    with db.connect() as conn:
        in_flight = counters.leased_by_server(conn)
        rows = [(s, in_flight.get(s.name, 0)) for s in registry.list_servers(conn)]
        sized = _windows(conn, [s.name for s, _ in rows])
        refused = status_reads.refusals_by_server(conn)
    if as_json:
        print_json(
            [
                s.to_json()
                | {
                    # items leased (with the workers' backlogs); the window counts requests
                    "in_flight": leased,
                    "leased": leased,
                    "window": _window_json(sized.get(s.name)),
                    "not_serving": refused.get(s.name, {}),
                }
                for s, leased in rows
            ]
        )
        return
    cells = [
        [
            s.name,
            _urls(s),
            s.state,
            _paused(s),
            str((s.fingerprint or {}).get("weight_version") or "—"),
            str(len(s.workers)),
            str(leased),
            _window_cell(sized.get(s.name)),
            _last_probe(s),
            _rendering(s),
            _not_serving(refused.get(s.name, {})),
            status_reads.current_error(s),
        ]
        for s, leased in rows
    ]
    lines, dropped = render(SERVER_COLUMNS, cells)
    if rows:
        # a fleet of hundreds of servers is read from this line first
        click.echo(servers_summary(rows))
    click.echo("\n".join(lines))
    note = left_out_note(dropped)
    if note:
        click.echo(note, err=True)


def servers_summary(rows: list[tuple[registry.ServerInfo, int]]) -> str:
    """One line over the servers table: how many servers in each state (most first), paused,
    workers and items leased (the `leased` column's sum), e.g. `256 servers: 250 healthy, 6 down;
    6 paused; 64 workers; 17,408 leased`."""
    by_state = count_states(server.state for server, _ in rows)
    paused = sum(1 for server, _ in rows if server.paused)
    workers = sum(len(server.workers) for server, _ in rows)
    leased = sum(count for _, count in rows)
    return f"{len(rows)} servers: {by_state}; {paused} paused; {workers} workers; {leased:,} leased"


# Names and URLs are never cut. A table wider than the terminal folds the rendering and the
# last error, then leaves out a column that says nothing (every cell `—`, as "not serving" on a
# fleet that serves every run), then last probe, workers, leased, rendering, last error,
# weights, paused, window and not serving, in that order; name, url and state always stay.
SERVER_COLUMNS = (
    Column("name"),
    Column("url"),
    Column("state"),
    Column("paused", drop=7, wrap=16),
    Column("weights", drop=6),
    Column("workers", right=True, drop=2),
    Column("leased", right=True, drop=3),
    Column("window", drop=8),
    Column("last probe", drop=1),
    Column("rendering", drop=4, wrap=12),
    Column("not serving", drop=9, wrap=24),
    Column("last error", drop=5, wrap=16),
)


def _not_serving(runs: dict[str, str]) -> str:
    """The active runs the server does not serve, each with why (`r1: its limits …`)."""
    from app.ledger import status_reads

    if not runs:
        return "—"
    reasons = sorted(runs.items())
    return "\n".join(f"{run}: {status_reads.refusal_reason(why)}" for run, why in reasons)


def _windows(conn: Connection, names: list[str]) -> dict[str, windows.ServerWindow]:
    """Each server's window as its workers last wrote it (servers without a live worker have
    none)."""
    from app.ledger import windows

    rows = windows.windows_by_server(conn, names, fresh_s=windows.FRESH_S)
    out = {name: windows.server_window(r) for name, r in rows.items()}
    return {name: w for name, w in out.items() if w is not None}


def _window_json(window: windows.ServerWindow | None) -> dict[str, object] | None:
    return None if window is None else window.to_json()


def _window_cell(window: windows.ServerWindow | None) -> str:
    """`auto: 272 requests (max_running 256)`, and below it, a line each, the server's load at
    the workers' last reading (`server: running 256 · queued 16`), its age when it is stale
    (`read 40s ago`), and why the size last changed."""
    from app.ledger import common

    if window is None:
        return "—"
    text = f"{window.mode}: {counted(window.size, 'request')}"
    lines = [text + (f" (max_running {window.max_running})" if window.max_running else "")]
    load = [
        f"{label} {n}"
        for label, n in (("running", window.running), ("queued", window.queued))
        if n is not None
    ]
    if load:
        lines.append("server: " + " · ".join(load))
        age_s = window.load_age_s(common.utcnow())
        if age_s is not None and age_s > STALE_LOAD_S:
            lines.append(f"read {_ago_s(age_s)}")
    if window.reason:
        lines.append(window.reason)
    return "\n".join(lines)


def _ago_s(seconds: float) -> str:
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _paused(server: registry.ServerInfo) -> str:
    """Whether the server is paused and by whom; a weights pause names the change
    ("weight_version: A → B"), an images pause the token drift."""
    if not server.paused:
        return "no"
    if server.paused_by in ("weights", "images", "failing"):
        return f"yes ({server.pause_reason})"
    return f"yes ({server.paused_by})"


def _last_probe(server: registry.ServerInfo) -> str:
    """When the last probe was made (by the watchdog, `tokenmill run`, a restart or a
    worker) and what it found: `3s ago ok`, `1s ago failed`."""
    if server.last_probe_at is None:
        return "—"
    return f"{_ago(server.last_probe_at)} {'ok' if server.last_probe_ok else 'failed'}"


def _urls(server: registry.ServerInfo) -> str:
    """The registered URL (the control plane's), and below it the URL its workers send to when
    that differs (a loopback URL on the GPU node)."""
    if server.worker_url and server.worker_url != server.url:
        return f"{server.url}\nworker: {server.worker_url}"
    return server.url


def _rendering(server: registry.ServerInfo) -> str:
    """What the parity preflight found: the runs whose prompts it renders differently."""
    differing = server.differing_runs()
    if differing:
        return "differs: " + ", ".join(differing)
    unchecked = sorted(
        r for r, p in (server.parity or {}).items() if p.get("status") == "unchecked"
    )
    if unchecked:
        return "not checked: " + ", ".join(unchecked)
    return "as stored" if server.parity else "—"


@servers_group.command("add")
@click.argument("name")
@click.argument("url")
@click.option(
    "--restart-command",
    default=None,
    help="Argument list (JSON) or a command line split like a shell would, run "
    "WITHOUT a shell; placeholders {name} {url} {host} {port}.",
)
@handle_errors
def servers_add(name: str, url: str, restart_command: str | None) -> None:
    """Register (or update) server NAME at URL."""
    from app.ledger import registry
    from workers.control.restart import parse_command

    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"URL must start with http:// or https://, got {url!r}")
    argv = parse_command(restart_command) if restart_command else None
    db = open_db()
    with db.begin() as conn:
        server = registry.upsert_server(conn, name, url.rstrip("/"), restart_command=argv)
    restart = f", restart: {shlex.join(argv)}" if argv else ""
    err_console().print(f"server {server.name} at {server.url}{restart}", markup=False)


@servers_group.command("remove")
@click.argument("name")
@handle_errors
def servers_remove(name: str) -> None:
    """Drop server NAME from the registry (a typo, a wrong port, a node gone for good).

    Refused while workers serve it or items are leased to it, naming them; its items keep
    their history.
    """
    from workers.control.pausing import alive_workers
    from workers.control.server_removal import remove_server

    server = remove_server(open_db(), name, alive_workers)
    err_console().print(f"server {server.name} at {server.url} removed", markup=False)


def _targets(server: tuple[str, ...], all_servers: bool) -> list[str]:
    from app.ledger import registry

    db = open_db()
    with db.connect() as conn:
        known = [s.name for s in registry.list_servers(conn)]
        if all_servers:
            return known
        if not server:
            raise ConfigurationError("name a server with --server NAME, or use --all")
        for name in server:
            registry.get_server(conn, name)  # NotFound lists the known ones
    return list(server)


@click.command("pause")
@click.option("--server", multiple=True, help="Server name (repeatable).")
@click.option("--all", "all_servers", is_flag=True, help="Every registered server.")
@click.option(
    "--reason",
    default="operator request",
    show_default=True,
    help="Why, for the timeline (`tokenmill events`).",
)
@handle_errors
def pause_cmd(server: tuple[str, ...], all_servers: bool, reason: str) -> None:
    """Stop the workers of these servers from taking work; the watchdog never lifts this."""
    from workers.control.pausing import CeleryControl, pause_server

    db = open_db()
    for name in _targets(server, all_servers):
        changed = pause_server(db, CeleryControl(), name, by=PAUSED_BY_OPERATOR, reason=reason)
        err_console().print(f"{name}: {'paused' if changed else 'already paused'}")


@click.command("resume")
@click.option("--server", multiple=True, help="Server name (repeatable).")
@click.option("--all", "all_servers", is_flag=True, help="Every registered server.")
@handle_errors
def resume_cmd(server: tuple[str, ...], all_servers: bool) -> None:
    """Let the workers of these servers take work again."""
    from workers.control.pausing import CeleryControl, resume_server

    db = open_db()
    for name in _targets(server, all_servers):
        changed = resume_server(db, CeleryControl(), name, by="operator", reason="operator request")
        err_console().print(f"{name}: {'resumed' if changed else 'was not paused'}")


@click.command("restart")
@click.argument("name")
@click.option(
    "--command",
    "command",
    default=None,
    help="Restart command for this time (else the server's registered one).",
)
@setting_option(
    "--timeout-s",
    type=float,
    default=None,
    setting="TOKENMILL_RESTART_TIMEOUT_S",
    shown_default="1800",
    help="Give up waiting for readiness after this many seconds (the server stays paused).",
)
@click.option(
    "--poll-s",
    type=float,
    default=2.0,
    show_default=True,
    help="Seconds between readiness probes while waiting.",
)
@handle_errors
def restart_cmd(name: str, command: str | None, timeout_s: float | None, poll_s: float) -> None:
    """Pause NAME, run its restart command, wait until ready, check the fingerprint, resume.

    "restarted" only when the server was seen to go away and come back; exit 1 when it never
    went down, or no longer fits an active run (each run's pins are printed against what the
    server reports: model, weights, limits).

    On a terminal one line is redrawn; in a pipe or a file a line is printed when the phase or
    the probe changes, and every 30 s while they do not. The restart command's output goes to
    a file under TOKENMILL_DATA_DIR/restarts/, named as it starts."""
    from rich.markup import escape

    from ops.views.progress import Progress
    from workers.control.pausing import CeleryControl
    from workers.control.restart import parse_command, restart_server

    settings = get_settings()
    db = open_db(settings)
    argv = parse_command(command) if command else None
    named: list[Path] = []

    def show(progress: Progress, p: RestartProgress) -> None:
        if not named:
            named.append(p.log_path)
            progress.say(f"{name}: the restart command's output goes to {p.log_path}")
        progress.show([_restart_line(name, p)])

    with Progress(err_console()) as progress:
        result = restart_server(
            db,
            settings,
            CeleryControl(),
            name,
            command=argv,
            timeout_s=timeout_s,
            poll_s=poll_s,
            on_progress=lambda p: show(progress, p),
        )
    console = err_console()
    if not named and result.log_path is not None:
        console.print(f"{name}: the restart command's output is in {result.log_path}", markup=False)
    for line in result.runs:  # what each active run pinned, against what the server reports
        console.print(f"{name}: {line}", markup=False)
    if result.ok:
        console.print(f"[green]{escape(result.message)}[/green]", markup=True)
    else:
        console.print(f"[red]{escape(result.message)}[/red]", markup=True)
        raise SystemExit(1)


RESTART_LINE_EVERY_S = 30  # in a pipe, an unchanged restart says it still waits this often


def _restart_line(name: str, p: RestartProgress) -> Line:
    from ops.views.progress import Line

    text = (
        f"{name}  {p.elapsed_s:5.0f}s  {p.phase}  probe: {p.probe}  "
        f"healthy probes in a row: {p.successes}"
    )
    state = (p.phase, p.probe, p.successes, int(p.elapsed_s // RESTART_LINE_EVERY_S))
    return Line("restart", text, state)


@click.command("events")
@click.option("--run", "run_name", default=None, help="Only this run (and fleet-wide events).")
@click.option("--server", default=None, help="Only this server.")
@click.option("--limit", type=int, default=200, show_default=True, help="The latest this many.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of event objects.")
@handle_errors
def events_cmd(run_name: str | None, server: str | None, limit: int, as_json: bool) -> None:
    """The timeline: state changes, pauses, resumes, restarts, fingerprint mismatches."""
    from app.ledger import registry, run_queries

    db = open_db()
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run_name).id if run_name else None
        rows = registry.list_events(conn, run_id=run_id, server=server, limit=limit)
    if as_json:
        print_json([e.to_json() for e in rows])
        return
    cells = [
        [
            f"{e.at:%Y-%m-%d %H:%M:%S}",
            e.kind,
            " ".join(x for x in (e.server, e.run) if x),
            e.message,
        ]
        for e in rows
    ]
    # the message folds; the time, kind, server and run are never cut, and none is left out
    lines, _ = render(EVENT_COLUMNS, cells)
    click.echo("\n".join(lines))


EVENT_COLUMNS = (Column("at (UTC)"), Column("kind"), Column("where"), Column("message", wrap=24))
