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

from app.ledger import dashboard_queries, status_reads
from ops.views.text_table import Column, count_states, fit

log = logging.getLogger(__name__)

BAR_WIDTH = 28
STATE_STYLES = {
    "healthy": "green",
    "suspect": "yellow",
    "down": "red",
    "recovering": "cyan",
    "draining": "yellow",
    "auth": "red",
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


Cell = tuple[str, RenderableType]  # the plain text (to measure) and what is drawn


def _fitted(
    title: str,
    columns: list[Column],
    rows: list[list[Cell]],
    width: int | None,
    *,
    empty: str,
    caption: str | None = None,
) -> Table:
    """A rich table of the columns that fit `width` (text_table.fit: names are never cut,
    columns of words fold, the others are left out in their stated order)."""
    plain = [[text for text, _ in row] for row in rows]
    # the table's outer padding takes a column on each side
    fitted = fit(columns, plain, 10**6 if width is None else width - 2)
    table = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        caption=caption,
        caption_justify="left",
    )
    for i, w in zip(fitted.kept, fitted.widths, strict=True):
        column = columns[i]
        table.add_column(
            column.header,
            justify="right" if column.right else "left",
            no_wrap=column.wrap is None,
            min_width=w,
            overflow="fold",
        )
    for row in rows:
        table.add_row(*(row[i][1] for i in fitted.kept))
    if not rows:
        table.add_row(f"[dim]{empty}[/dim]", *[""] * (len(fitted.kept) - 1))
    if fitted.dropped:
        note = f"(left out at this width: {', '.join(fitted.dropped)})"
        table.caption = f"{caption}\n{note}" if caption else note
    return table


def _text(value: str) -> Cell:
    return value, escape(value)


# Names are never cut; in a narrow terminal each table leaves columns out in this order (the
# `drop` numbers): runs: progress, truncated, done, out tokens, tok/s; servers: workers, p50,
# p95, tok/s, last probe, paused, last error; events: none, the message folds.
RUN_COLUMNS = [
    Column("run"),
    Column("progress", drop=1),
    Column("finished", right=True),
    Column("done", right=True, drop=3),
    Column("truncated", right=True, drop=2),
    Column("failed", right=True),
    Column("out tokens", right=True, drop=4),
    Column("tok/s (1m)", right=True, drop=5),
    Column("ETA", right=True),
]


def _runs_table(
    runs: list[dashboard_queries.RunProgress], not_shown: int, width: int | None
) -> Table:
    rows: list[list[Cell]] = []
    for run in runs:
        c = run.counts
        pct = 100 * run.finished / c.total if c.total else 100.0
        finished = f"{run.finished}/{c.total} {pct:3.0f}%" + (
            f" ({c.waiting} waiting)" if c.waiting else ""  # later turns of chains
        )
        # a run of another priority than the default says so beside its name
        name = f"{c.run} (priority {run.priority})" if run.priority else c.run
        rows.append(
            [
                _text(name),
                (
                    "#" * BAR_WIDTH,
                    ProgressBar(total=max(c.total, 1), completed=run.finished, width=BAR_WIDTH),
                ),
                _text(finished),
                _text(str(c.done)),
                _text(str(c.truncated)),
                (str(c.failed), f"[red]{c.failed}[/red]" if c.failed else "0"),
                _text(f"{c.output_tokens:,}"),
                _text(f"{run.tokens_per_s:,.0f}"),
                _text("done" if run.remaining == 0 else duration(run.eta_s)),
            ]
        )
    caption = (
        f"… {not_shown} older runs not shown (name one: status RUN --watch)" if not_shown else None
    )
    return _fitted("runs", RUN_COLUMNS, rows, width, empty="no runs yet", caption=caption)


def _state(row: dashboard_queries.ServerRow) -> str:
    if row.info is None:
        return "[dim]unregistered[/dim]"
    style = STATE_STYLES.get(row.info.state, "dim")
    return f"[{style}]{escape(row.info.state)}[/{style}]"


def _paused(row: dashboard_queries.ServerRow) -> str:
    if row.info is None:
        return "—"
    if not row.info.paused:
        return "no"
    return f"[yellow]yes[/yellow] ({escape(row.info.paused_by or '?')})"


def _probe(row: dashboard_queries.ServerRow, now: datetime) -> str:
    if row.info is None or row.info.last_probe_at is None:
        return "—"
    verdict = "ok" if row.info.last_probe_ok else "[red]failed[/red]"
    return f"{_ago(row.info.last_probe_at, now)} {verdict}"


SERVER_COLUMNS = [
    Column("server"),
    Column("state"),
    Column("paused", drop=6),
    Column("workers", right=True, drop=1),
    Column("in flight", right=True),
    Column("tok/s (1m)", right=True, drop=4),
    Column("p50", right=True, drop=2),
    Column("p95", right=True, drop=3),
    Column("last probe", drop=5),
    Column("last error", drop=7, wrap=16),
]


# a fleet's servers beyond this many: the ones that need a look (not healthy, or paused) first,
# the rest counted in the caption
SERVER_ROWS_SHOWN = 24


def servers_title(servers: list[dashboard_queries.ServerRow]) -> str:
    """The servers table's title: how many, by state (most first), paused and in flight."""
    if not servers:
        return "servers"
    by_state = count_states(row.info.state if row.info else "unregistered" for row in servers)
    paused = sum(1 for row in servers if row.info is not None and row.info.paused)
    in_flight = sum(row.in_flight for row in servers)
    return f"servers: {len(servers)} ({by_state}); {paused} paused; {in_flight:,} in flight"


def _shown(
    servers: list[dashboard_queries.ServerRow],
) -> tuple[list[dashboard_queries.ServerRow], int]:
    """The rows drawn and how many are left out: all of a small fleet in its order; of a large
    one, the servers that need a look first (not healthy, or paused), then the others."""
    if len(servers) <= SERVER_ROWS_SHOWN:
        return servers, 0

    def calm(row: dashboard_queries.ServerRow) -> bool:
        return row.info is not None and row.info.state == "healthy" and not row.info.paused

    ordered = sorted(servers, key=calm)  # stable: each part keeps its order
    return ordered[:SERVER_ROWS_SHOWN], len(servers) - SERVER_ROWS_SHOWN


def _servers_table(
    servers: list[dashboard_queries.ServerRow], now: datetime, width: int | None
) -> Table:
    rows: list[list[Cell]] = []
    shown, not_shown = _shown(servers)
    for row in shown:
        paused, probe = _paused(row), _probe(row, now)
        rows.append(
            [
                _text(row.name),
                (row.info.state if row.info else "unregistered", _state(row)),
                (Text.from_markup(paused).plain, paused),
                _text(str(len(row.info.workers)) if row.info else "—"),
                _text(str(row.in_flight)),
                _text(f"{row.tokens_per_s:,.0f}"),
                _text(_latency(row.latency_p50_s)),
                _text(_latency(row.latency_p95_s)),
                (Text.from_markup(probe).plain, probe),
                _text(status_reads.current_error(row.info) if row.info else ""),
            ]
        )
    caption = (
        f"({not_shown} more servers not shown: those that need a look come first)"
        if not_shown
        else None
    )
    return _fitted(
        servers_title(servers),
        SERVER_COLUMNS,
        rows,
        width,
        empty="no servers registered or working",
        caption=caption,
    )


EVENT_COLUMNS = [Column("at (UTC)"), Column("kind"), Column("server"), Column("message", wrap=24)]


def _events_table(dashboard: dashboard_queries.Dashboard, width: int | None) -> Table:
    rows = [
        [
            _text(event.at.strftime("%H:%M:%S")),
            _text(event.kind),
            _text(event.server or ""),
            _text(event.message.splitlines()[0] if event.message else ""),
        ]
        for event in reversed(dashboard.events)  # newest first, next to the header
    ]
    return _fitted("latest events", EVENT_COLUMNS, rows, width, empty="none")


def render_dashboard(
    dashboard: dashboard_queries.Dashboard,
    *,
    interval_s: float | None = None,
    problem: str | None = None,
    width: int | None = None,
) -> RenderableType:
    """The whole screen for one tick, its tables fitted to `width` (None: as wide as needed)."""
    header = Text.assemble(
        ("tokenmill status", "bold"),
        f"  {dashboard.at:%Y-%m-%d %H:%M:%S} UTC",
        f"  every {interval_s:g}s · Ctrl-C to exit" if interval_s is not None else "",
    )
    parts: list[RenderableType] = [header]
    if problem:
        parts.append(Text(f"stale: {problem}", style="red"))
    for table in (
        _runs_table(dashboard.runs, dashboard.runs_not_shown, width),
        _servers_table(dashboard.servers, dashboard.at, width),
        _events_table(dashboard, width),
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

    def gather() -> dashboard_queries.Dashboard:
        from app.ledger import database

        with db.connect() as conn:
            database.limit_periodic(conn)  # every tick: a statement timeout, no JIT, index plans
            return dashboard_queries.gather_dashboard(conn, run_name=run_name)

    current = gather()
    drawn = 0
    try:
        with Live(
            render_dashboard(current, interval_s=interval_s, width=console.width),
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
                    render_dashboard(
                        current, interval_s=interval_s, problem=problem, width=console.width
                    ),
                    refresh=True,
                )
                drawn += 1
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a watch ends: exit 0, last picture left on screen
