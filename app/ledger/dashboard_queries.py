"""Read-only named queries behind the operator views: `status --watch` and `report`.

Each runs unchanged on Postgres and SQLite; rates and percentiles are computed here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table, and_, func, or_, select

from app.core.models import ItemStatus
from app.ledger import common, counters, database, reads, registry, run_queries

RATE_WINDOW_S = 60.0
LATENCY_SAMPLE = 200  # the latest completions per server behind p50/p95
EVENTS_SHOWN = 8
RUNS_SHOWN = 8
FINISHED = (ItemStatus.DONE.value, ItemStatus.FAILED.value)


# --- named queries: the dashboard ------------------------------------------------------


@dataclass(frozen=True)
class RecentCompletions:
    """Items of one run that one server finished (done or failed) within a time window."""

    run_id: int
    server: str | None
    finished: int
    output_tokens: int


def servers_seen(conn: Connection) -> list[str]:
    """Every server name on any item, by a loose index scan: one index probe per server,
    however many items there are (a DISTINCT would read the whole index)."""
    # "IS NOT NULL" names the predicate of the server's index (partial: items sent somewhere)
    seen = (
        select(func.min(common.items.c.server).label("server"))
        .where(common.items.c.server.is_not(None))
        .cte("seen", recursive=True)
    )
    following = (
        select(func.min(common.items.c.server))
        .where(common.items.c.server > seen.c.server)
        .scalar_subquery()
    )
    seen = seen.union_all(select(following).where(seen.c.server.is_not(None)))
    stmt = select(seen.c.server).where(seen.c.server.is_not(None))
    return [str(name) for name in conn.execute(stmt).scalars()]


def recent_completions(
    conn: Connection, *, since: datetime, servers: Sequence[str] | None = None
) -> list[RecentCompletions]:
    """Finished items and their output tokens per (run, server) since `since`. Naming the
    servers (all of them: `servers_seen`) lets the (server, finished_at) index find only
    the recent rows instead of scanning the table."""
    stmt = (
        select(
            common.items.c.run_id,
            common.items.c.server,
            func.count(),
            func.coalesce(func.sum(common.items.c.completion_tokens), 0),
        )
        .where(common.items.c.finished_at >= since, common.items.c.status.in_(FINISHED))
        .group_by(common.items.c.run_id, common.items.c.server)
    )
    if servers is not None:
        stmt = stmt.where(common.items.c.server.in_(list(servers)))
    return [
        RecentCompletions(int(run_id), server, int(n), int(tokens))
        for run_id, server, n, tokens in conn.execute(stmt)
    ]


def inflight_by_server(conn: Connection) -> dict[str, int]:
    """Items leased right now, per server (from the item counters)."""
    return counters.leased_by_server(conn)


def recent_latencies(conn: Connection, server: str, *, limit: int = LATENCY_SAMPLE) -> list[float]:
    """End-to-end latencies of the server's latest `limit` completed items, newest first."""
    stmt = (
        select(common.items.c.latency_s)
        .where(
            common.items.c.server == server,
            common.items.c.status == ItemStatus.DONE.value,
            common.items.c.latency_s.is_not(None),
        )
        # the order of ix_items_done_finished (server, finished_at), so the latest are the
        # first entries of the server's range; a tie-break on id made it sort all of them
        .order_by(common.items.c.finished_at.desc())
        .limit(limit)
    )
    return [float(v) for v in conn.execute(stmt).scalars()]


def percentile(values: Sequence[float], pct: float) -> float | None:
    """The nearest-rank percentile (a value that occurred); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# --- the dashboard's picture ------------------------------------------------------------


@dataclass(frozen=True)
class RunProgress:
    counts: reads.RunCounts
    recent_finished: int
    recent_tokens: int
    window_s: float
    # the run's priority (higher first; 0 by default)
    priority: int = 0

    @property
    def finished(self) -> int:
        return self.counts.done + self.counts.failed

    @property
    def remaining(self) -> int:
        return self.counts.total - self.finished

    @property
    def tokens_per_s(self) -> float:
        return self.recent_tokens / self.window_s

    @property
    def eta_s(self) -> float | None:
        """Seconds to finish at the last window's pace; None while nothing finishes."""
        if self.remaining == 0:
            return 0.0
        if self.recent_finished == 0:
            return None
        return self.remaining * self.window_s / self.recent_finished


@dataclass(frozen=True)
class ServerRow:
    name: str
    info: (
        registry.ServerInfo | None
    )  # None: seen on items but not in the registry (`tokenmill run`)
    in_flight: int
    recent_tokens: int
    window_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.recent_tokens / self.window_s


@dataclass(frozen=True)
class Dashboard:
    at: datetime
    runs: list[RunProgress]
    runs_not_shown: int
    servers: list[ServerRow]
    events: list[registry.EventInfo]


def gather_dashboard(
    conn: Connection,
    *,
    run_name: str | None = None,
    now: datetime | None = None,
    window_s: float = RATE_WINDOW_S,
    max_runs: int = RUNS_SHOWN,
    events_shown: int = EVENTS_SHOWN,
    latency_sample: int = LATENCY_SAMPLE,
) -> Dashboard:
    """One consistent-enough picture for a dashboard tick: the named run (or the latest
    `max_runs` runs), every server (registered, or seen on work), the latest events."""
    now = now or common.utcnow()
    if run_name is not None:
        shown: list[run_queries.RunInfo] = [run_queries.get_run(conn, run_name)]
        hidden = 0
    else:
        every = run_queries.list_runs(conn)
        shown = every[-max_runs:] if max_runs > 0 else []
        hidden = len(every) - len(shown)
    since = now - timedelta(seconds=window_s)
    recent = recent_completions(conn, since=since, servers=servers_seen(conn))
    by_run: dict[int, tuple[int, int]] = {}
    by_server: dict[str, int] = {}
    for r in recent:
        finished, tokens = by_run.get(r.run_id, (0, 0))
        by_run[r.run_id] = (finished + r.finished, tokens + r.output_tokens)
        if r.server is not None:
            by_server[r.server] = by_server.get(r.server, 0) + r.output_tokens
    runs = [
        RunProgress(
            reads.run_counts(conn, run), *by_run.get(run.id, (0, 0)), window_s, run.priority
        )
        for run in shown
    ]
    inflight = inflight_by_server(conn)
    registered = {s.name: s for s in registry.list_servers(conn)}
    names = sorted(set(registered) | set(inflight) | set(by_server))
    servers = []
    for name in names:
        latencies = recent_latencies(conn, name, limit=latency_sample)
        servers.append(
            ServerRow(
                name=name,
                info=registered.get(name),
                in_flight=inflight.get(name, 0),
                recent_tokens=by_server.get(name, 0),
                window_s=window_s,
                latency_p50_s=percentile(latencies, 50),
                latency_p95_s=percentile(latencies, 95),
            )
        )
    run_id = shown[0].id if run_name is not None else None
    latest = registry.list_events(conn, run_id=run_id, limit=events_shown) if events_shown else []
    return Dashboard(at=now, runs=runs, runs_not_shown=hidden, servers=servers, events=latest)


# --- named queries: the report ----------------------------------------------------------


@dataclass(frozen=True)
class ItemStats:
    """An item's numbers without its token arrays: what a report plots."""

    id: int
    status: str
    server: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int | None
    latency_s: float | None
    started_at: datetime | None
    finished_at: datetime | None


def iter_item_stats(
    conn: Connection,
    run_id: int,
    *,
    statuses: Sequence[str] = FINISHED,
    page_size: int = 5000,
) -> Iterator[ItemStats]:
    """Stream a run's item numbers in id order, a keyset page at a time (memory stays flat,
    and unlike `ledger.iter_items` no token array is read); archived rows included."""
    streams = [
        _stat_pages(conn, table, run_id, status, page_size)
        for table in (common.items, common.items_archive)
        for status in dict.fromkeys(statuses)
    ]
    for page in reads.merged_pages(streams, page_size):
        yield from page


def _stat_pages(
    conn: Connection, table: Table, run_id: int, status: str, page_size: int
) -> Iterator[list[ItemStats]]:
    """`run_id = ? AND status = ? AND id > last ORDER BY id LIMIT n` over (run_id, status, id)."""
    database.pin_index_plans(conn)
    after = 0
    while True:
        stmt = (
            select(*(table.c[name] for name in ItemStats.__dataclass_fields__))
            .where(common.run_status_range(conn, table, run_id, status, after))
            .order_by(*common.run_status_order(table))
            .limit(page_size)
        )
        page = [
            ItemStats(
                id=row.id,
                status=row.status,
                server=row.server,
                finish_reason=row.finish_reason,
                prompt_tokens=row.prompt_tokens,
                completion_tokens=row.completion_tokens,
                latency_s=row.latency_s,
                started_at=common.as_utc(row.started_at),
                finished_at=common.as_utc(row.finished_at),
            )
            for row in conn.execute(stmt)
        ]
        if not page:
            return
        yield page
        if len(page) < page_size:
            return
        after = page[-1].id


@dataclass(frozen=True)
class ItemRanges:
    """Extremes of a run's finished items: what fixes a report's bins before streaming."""

    first_started_at: datetime | None
    first_finished_at: datetime | None
    last_finished_at: datetime | None
    min_latency_s: float | None
    max_latency_s: float | None
    max_completion_tokens: int | None


def item_ranges(conn: Connection, run_id: int) -> ItemRanges:
    # extremes of both tables (a row in both counts the same twice): archived rows included
    rows = [
        conn.execute(
            select(
                func.min(t.c.started_at),
                func.min(t.c.finished_at),
                func.max(t.c.finished_at),
                func.min(t.c.latency_s),
                func.max(t.c.latency_s),
                func.max(t.c.completion_tokens),
            ).where(t.c.run_id == run_id, t.c.status.in_(FINISHED))
        ).one()
        for t in (common.items, common.items_archive)
    ]
    lows = (0, 1, 3)
    started, first, last, lat_min, lat_max, completion_max = (
        _extreme([r[i] for r in rows], low=i in lows) for i in range(6)
    )
    return ItemRanges(
        first_started_at=common.as_utc(started),
        first_finished_at=common.as_utc(first),
        last_finished_at=common.as_utc(last),
        min_latency_s=None if lat_min is None else float(lat_min),
        max_latency_s=None if lat_max is None else float(lat_max),
        max_completion_tokens=None if completion_max is None else int(completion_max),
    )


def _extreme(values: list[Any], *, low: bool) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return min(present) if low else max(present)


def failure_reasons(
    conn: Connection, run_id: int, *, limit: int = 10, chars: int = 160
) -> list[tuple[str, int]]:
    """The most common errors of a run's failed items (first `chars` characters), by count
    (archived rows included)."""
    counts: dict[str, int] = {}
    for t in (common.items, common.items_archive):
        reason = func.coalesce(func.substr(t.c.error, 1, chars), "(no error recorded)")
        stmt = (
            select(reason.label("reason"), func.count().label("n"))
            .where(t.c.run_id == run_id, t.c.status == ItemStatus.FAILED.value)
            .group_by("reason")  # by label: Postgres sees the bound substr() arguments as new
        )
        if t is common.items_archive:  # rows copied and not yet deleted are counted once
            stmt = stmt.where(
                ~select(common.items.c.id).where(common.items.c.id == t.c.id).exists()
            )
        for r, n in conn.execute(stmt):
            counts[str(r)] = counts.get(str(r), 0) + int(n)
    ranked = sorted(counts.items(), key=lambda rn: (-rn[1], rn[0]))
    return ranked[:limit]


@dataclass(frozen=True)
class ServerEvent:
    at: datetime
    kind: str
    server: str


def server_events(
    conn: Connection, *, kinds: Sequence[str], since: datetime, until: datetime
) -> list[ServerEvent]:
    """Events of these kinds between since and until, plus each server's latest one before
    since (so a state that began earlier is known), oldest first."""
    kind_filter = and_(common.events.c.kind.in_(list(kinds)), common.events.c.server.is_not(None))
    before = (
        select(func.max(common.events.c.id))
        .where(kind_filter, common.events.c.at < since)
        .group_by(common.events.c.server)
    )
    stmt = (
        select(common.events.c.at, common.events.c.kind, common.events.c.server)
        .where(
            kind_filter,
            or_(
                common.events.c.id.in_(before),
                and_(common.events.c.at >= since, common.events.c.at <= until),
            ),
        )
        .order_by(common.events.c.at, common.events.c.id)
    )
    return [
        ServerEvent(at=common.as_utc(at) or since, kind=kind, server=str(server))
        for at, kind, server in conn.execute(stmt)
    ]
