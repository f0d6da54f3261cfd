"""Operator commands for the server fleet: servers, pause, resume, restart, events.

Every change goes through the durable ledger flag plus Celery remote control, and lands in
the event timeline.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

import click

from app.core.errors import ConfigurationError
from ops.options import err_console, get_settings, handle_errors, open_db, print_json, print_table

if TYPE_CHECKING:
    from rich.table import Table

    from app.ledger import registry
    from ops.restart import RestartProgress


def _ago(at: datetime | None) -> str:
    from app.ledger import utcnow

    if at is None:
        return "—"
    seconds = (utcnow() - at).total_seconds()
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


@click.group("servers", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="A JSON list of server objects.")
@click.pass_context
@handle_errors
def servers_group(ctx: click.Context, as_json: bool) -> None:
    """List the SGLang servers: state, pause, workers, in flight, last probe and error."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    from app.ledger import counters, registry

    db = open_db()
    with db.connect() as conn:
        in_flight = counters.leased_by_server(conn)
        rows = [(s, in_flight.get(s.name, 0)) for s in registry.list_servers(conn)]
    if as_json:
        print_json([s.to_json() | {"in_flight": leased} for s, leased in rows])
        return
    table = Table(
        "name",
        "url",
        "state",
        "paused",
        "weights",
        "workers",
        "in flight",
        "last probe",
        "rendering",
        "last error",
    )
    for s, leased in rows:
        paused = f"yes ({s.paused_by})" if s.paused else "no"
        if s.paused and s.paused_by == "weights":  # name the change: "weight_version: A → B"
            paused = f"yes ({s.pause_reason})"
        table.add_row(
            s.name,
            s.url,
            s.state,
            paused,
            str((s.fingerprint or {}).get("weight_version") or "—"),
            str(len(s.workers)),
            str(leased),
            _ago(s.last_probe_at),
            _rendering(s),
            (s.last_error or "")[:60],
        )
    print_table(table)


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
    from ops.restart import parse_command

    if not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"URL must start with http:// or https://, got {url!r}")
    argv = parse_command(restart_command) if restart_command else None
    db = open_db()
    with db.begin() as conn:
        server = registry.upsert_server(conn, name, url.rstrip("/"), restart_command=argv)
    restart = f", restart: {argv}" if argv else ""
    err_console().print(f"server {server.name} at {server.url}{restart}")


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
@click.option("--reason", default="operator request", show_default=True)
@handle_errors
def pause_cmd(server: tuple[str, ...], all_servers: bool, reason: str) -> None:
    """Stop the workers of these servers from taking work; the watchdog never lifts this."""
    from app.ledger import registry
    from workers.control.pausing import CeleryControl, pause_server

    db = open_db()
    for name in _targets(server, all_servers):
        changed = pause_server(
            db, CeleryControl(), name, by=registry.PAUSED_BY_OPERATOR, reason=reason
        )
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
@click.option(
    "--timeout-s",
    type=float,
    default=None,
    help="Give up waiting for readiness after this long (TOKENMILL_RESTART_TIMEOUT_S).",
)
@click.option("--poll-s", type=float, default=2.0, show_default=True)
@handle_errors
def restart_cmd(name: str, command: str | None, timeout_s: float | None, poll_s: float) -> None:
    """Pause NAME, run its restart command, wait until ready, check the fingerprint, resume."""
    from rich.live import Live
    from rich.table import Table

    from ops.restart import parse_command, restart_server
    from workers.control.pausing import CeleryControl

    settings = get_settings()
    db = open_db(settings)
    argv = parse_command(command) if command else None

    def view(p: RestartProgress) -> Table:
        table = Table.grid(padding=(0, 2))
        table.add_row(
            f"[bold]{name}[/bold]",
            f"{p.elapsed_s:5.0f}s",
            p.phase,
            f"probe: {p.probe}",
            f"healthy probes in a row: {p.successes}",
        )
        return table

    console = err_console()
    with Live(console=console, refresh_per_second=4, transient=False) as live:
        result = restart_server(
            db,
            settings,
            CeleryControl(),
            name,
            command=argv,
            timeout_s=timeout_s,
            poll_s=poll_s,
            on_progress=lambda p: live.update(view(p)),
        )
    if result.ok:
        console.print(f"[green]{result.message}[/green]", markup=True)
    else:
        console.print(f"[red]{result.message}[/red]", markup=True)
        raise SystemExit(1)


@click.command("events")
@click.option("--run", "run_name", default=None, help="Only this run (and fleet-wide events).")
@click.option("--server", default=None, help="Only this server.")
@click.option("--limit", type=int, default=200, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def events_cmd(run_name: str | None, server: str | None, limit: int, as_json: bool) -> None:
    """The timeline: state changes, pauses, resumes, restarts, fingerprint mismatches."""
    from app import ledger
    from app.ledger import registry

    db = open_db()
    with db.connect() as conn:
        run_id = ledger.get_run(conn, run_name).id if run_name else None
        rows = registry.list_events(conn, run_id=run_id, server=server, limit=limit)
    if as_json:
        print_json([e.to_json() for e in rows])
        return
    for e in rows:
        where = " ".join(x for x in (e.server, e.run) if x)
        click.echo(f"{e.at:%Y-%m-%d %H:%M:%S}  {e.kind:<20} {where:<20} {e.message}")
