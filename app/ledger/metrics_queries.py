"""Named ledger queries behind the Prometheus metrics: item aggregates, latencies, server rows.

Every figure is read from the shared ledger at scrape time, so it is the same whichever process
is asked and however many worker processes write results.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from sqlalchemy import Connection, Engine, select

from app.ledger import common, counters, database, registry, windows


@dataclass(frozen=True)
class ItemGroup:
    """How many items of one run share a server, status and finish reason, and their tokens."""

    run: str
    server: str | None
    status: str
    finish_reason: str | None
    items: int
    completion_tokens: int
    hedged: int = 0  # of those items, how many got a second copy (hedging at the end of a run)


@dataclass(frozen=True)
class LatencyHistogram:
    """End-to-end latencies of a server's finished items: cumulative counts per bucket."""

    server: str | None
    buckets_s: tuple[float, ...]
    cumulative: tuple[int, ...]
    count: int
    sum_s: float


@dataclass(frozen=True)
class LedgerSnapshot:
    """Everything a scrape reports from the ledger, read in one transaction."""

    run_names: list[str]
    groups: list[ItemGroup]
    latencies: list[LatencyHistogram]
    servers: list[registry.ServerInfo]
    # each server's window as its live workers keep it (app.ledger.windows)
    server_windows: dict[str, windows.ServerWindow] = field(default_factory=dict)
    # each run's priority (higher first), by name
    run_priorities: dict[str, int] = field(default_factory=dict)


def run_names(conn: Connection) -> list[str]:
    """Every run, including those without items yet."""
    return list(conn.execute(select(common.runs.c.name).order_by(common.runs.c.id)).scalars())


def run_priorities(conn: Connection) -> dict[str, int]:
    """Every run's priority, by name."""
    return {
        str(r[0]): int(r[1])
        for r in conn.execute(select(common.runs.c.name, common.runs.c.priority))
    }


def item_groups(conn: Connection) -> list[ItemGroup]:
    """Item counts and completion tokens by run, server, status and finish reason (from the
    item counters: O(runs × servers × statuses), however many items there are)."""
    names = {
        run_id: name for run_id, name in conn.execute(select(common.runs.c.id, common.runs.c.name))
    }
    return [
        ItemGroup(
            run=names[key.run_id],
            server=key.server,
            status=key.status,
            finish_reason=key.finish_reason,
            items=tally.items,
            completion_tokens=tally.completion_tokens,
            hedged=tally.hedged,
        )
        for key, tally in counters.counted_groups(conn).items()
        if key.run_id in names
    ]


def latency_histograms(conn: Connection) -> list[LatencyHistogram]:
    """Per server, a histogram of the recorded latency of items that finished with a result,
    over LATENCY_BUCKETS_S (read from the latency counters)."""
    bounds = counters.LATENCY_BUCKETS_S
    per_server: dict[str | None, list[int]] = {}
    sums: dict[str | None, float] = {}
    for key, tally in counters.counted_latencies(conn).items():
        # one slot per bucket, the last one past every bound
        slots = per_server.setdefault(key.server, [0] * (len(bounds) + 1))
        slots[key.bucket] += tally.items
        sums[key.server] = sums.get(key.server, 0.0) + tally.sum_s
    return [
        LatencyHistogram(
            server=server,
            buckets_s=bounds,
            cumulative=tuple(itertools.accumulate(slots[: len(bounds)])),
            count=sum(slots),
            sum_s=sums[server],
        )
        for server, slots in per_server.items()
    ]


def read_snapshot(engine: Engine) -> LedgerSnapshot:
    """All metric queries in one read-only transaction (one snapshot on Postgres)."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
        with conn.begin():
            database.limit_periodic(conn)  # every scrape: a statement timeout, no JIT, index plans
            servers = registry.list_servers(conn)
            rows = windows.windows_by_server(
                conn, [s.name for s in servers], fresh_s=windows.FRESH_S
            )
            sized = {name: windows.server_window(r) for name, r in rows.items()}
            return LedgerSnapshot(
                run_names=run_names(conn),
                groups=item_groups(conn),
                latencies=latency_histograms(conn),
                servers=servers,
                server_windows={name: w for name, w in sized.items() if w is not None},
                run_priorities=run_priorities(conn),
            )
