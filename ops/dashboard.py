"""The live terminal dashboard of `tokenmill status --watch`: runs, servers, latest events.

Rendering is a pure function of a `Dashboard` picture; `watch` redraws it in place until Ctrl-C.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from app.ledger.dashboard_queries import Dashboard, RunProgress, ServerRow, gather_dashboard

log = logging.getLogger(__name__)

BAR_WIDTH = 28
ERROR_CHARS = 60
MESSAGE_CHARS = 100
STATE_STYLES = {
    "healthy": "green",
    "suspect": "yellow",
    "down": "red",
    "recovering": "cyan",
}


def duration(seconds: float | None) -> str:
    """A short human duration: 45s, 3m 20s, 2h 05m; an em dash when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "—"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 100 * 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _ago(at: datetime | None, now: datetime) -> str:
    return "—" if at is None else duration((now - at).total_seconds()) + " ago"


def _latency(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.1f}s"


def _runs_table(runs: list[RunProgress], not_shown: int) -> Table:
    table = Table(
        title="runs",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        caption=f"… {not_shown} older runs not shown (name one: status RUN --watch)"
        if not_shown
        else None,
        caption_justify="left",
    )
    for name in ("run", "progress", "finished", "done", "truncated", "failed", "out tokens"):
        table.add_column(name, justify="left" if name in ("run", "progress") else "right")
    table.add_column("tok/s (1m)", justify="right")
    table.add_column("ETA", justify="right")
    for run in runs:
        c = run.counts
        pct = 100 * run.finished / c.total if c.total else 100.0
        table.add_row(
            escape(c.run),
            ProgressBar(total=max(c.total, 1), completed=run.finished, width=BAR_WIDTH),
            f"{run.finished}/{c.total} {pct:3.0f}%"
            + (f" ({c.waiting} waiting)" if c.waiting else ""),  # later turns of chains
            str(c.done),
            str(c.truncated),
            f"[red]{c.failed}[/red]" if c.failed else "0",
            f"{c.output_tokens:,}",
            f"{run.tokens_per_s:,.0f}",
            "done" if run.remaining == 0 else duration(run.eta_s),
        )
    if not runs:
        table.add_row("[dim]no runs yet[/dim]", *[""] * 8)
    return table


def _state(row: ServerRow) -> str:
    if row.info is None:
        return "[dim]unregistered[/dim]"
    style = STATE_STYLES.get(row.info.state, "dim")
    return f"[{style}]{escape(row.info.state)}[/{style}]"


def _paused(row: ServerRow) -> str:
    if row.info is None:
        return "—"
    if not row.info.paused:
        return "no"
    return f"[yellow]yes[/yellow] ({escape(row.info.paused_by or '?')})"


def _probe(row: ServerRow, now: datetime) -> str:
    if row.info is None or row.info.last_probe_at is None:
        return "—"
    verdict = "ok" if row.info.last_probe_ok else "[red]failed[/red]"
    return f"{_ago(row.info.last_probe_at, now)} {verdict}"


def _servers_table(servers: list[ServerRow], now: datetime) -> Table:
    table = Table(
        title="servers",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    table.add_column("server")
    table.add_column("state")
    table.add_column("paused")
    for name in ("workers", "in flight", "tok/s (1m)", "p50", "p95"):
        table.add_column(name, justify="right")
    table.add_column("last probe")
    table.add_column("last error", overflow="ellipsis", no_wrap=True, max_width=ERROR_CHARS)
    for row in servers:
        error = (row.info.last_error or "") if row.info else ""
        table.add_row(
            escape(row.name),
            _state(row),
            _paused(row),
            str(len(row.info.workers)) if row.info else "—",
            str(row.in_flight),
            f"{row.tokens_per_s:,.0f}",
            _latency(row.latency_p50_s),
            _latency(row.latency_p95_s),
            _probe(row, now),
            escape(error.splitlines()[0][:ERROR_CHARS]) if error else "",
        )
    if not servers:
        table.add_row("[dim]no servers registered or working[/dim]", *[""] * 9)
    return table


def _events_table(dashboard: Dashboard) -> Table:
    table = Table(
        title="latest events",
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    table.add_column("at (UTC)")
    table.add_column("kind")
    table.add_column("server")
    table.add_column("message", overflow="ellipsis", no_wrap=True, max_width=MESSAGE_CHARS)
    for event in reversed(dashboard.events):  # newest first, next to the header
        table.add_row(
            event.at.strftime("%H:%M:%S"),
            escape(event.kind),
            escape(event.server or ""),
            escape(event.message.splitlines()[0] if event.message else ""),
        )
    if not dashboard.events:
        table.add_row("[dim]none[/dim]", "", "", "")
    return table


def render_dashboard(
    dashboard: Dashboard, *, interval_s: float | None = None, problem: str | None = None
) -> RenderableType:
    """The whole screen for one tick."""
    header = Text.assemble(
        ("tokenmill status", "bold"),
        f"  {dashboard.at:%Y-%m-%d %H:%M:%S} UTC",
        f"  every {interval_s:g}s · Ctrl-C to exit" if interval_s is not None else "",
    )
    parts: list[RenderableType] = [header]
    if problem:
        parts.append(Text(f"stale: {problem}", style="red"))
    for table in (
        _runs_table(dashboard.runs, dashboard.runs_not_shown),
        _servers_table(dashboard.servers, dashboard.at),
        _events_table(dashboard),
    ):
        parts += [Text(""), table]
    return Group(*parts)


def watch(
    db: Engine,
    *,
    run_name: str | None,
    interval_s: float,
    console: Console,
    ticks: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Redraw the dashboard in place every interval_s until Ctrl-C (or `ticks` redraws).

    The first picture is taken before the display starts, so a bad run name or an
    unreachable database fails like any command; later database errors keep the last
    picture on screen, marked stale, and the next tick tries again.
    """

    def gather() -> Dashboard:
        from app.ledger.database import limit_periodic

        with db.connect() as conn:
            limit_periodic(conn)  # every tick: a statement timeout, no JIT, index plans
            return gather_dashboard(conn, run_name=run_name)

    current = gather()
    drawn = 0
    try:
        with Live(
            render_dashboard(current, interval_s=interval_s),
            console=console,
            auto_refresh=False,
            transient=False,
        ) as live:
            while ticks is None or drawn < ticks:
                sleep(interval_s)
                problem = None
                try:
                    current = gather()
                except SQLAlchemyError as exc:
                    log.debug("dashboard refresh failed: %s", exc)
                    problem = f"the database did not answer ({type(exc).__name__}); retrying"
                live.update(
                    render_dashboard(current, interval_s=interval_s, problem=problem), refresh=True
                )
                drawn += 1
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends: exit 0, last picture left on screen
