"""Named ledger queries behind the Prometheus metrics: item aggregates, latencies, server rows.

Every figure is read from the shared ledger at scrape time, so it is the same whichever process
is asked and however many worker processes write results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, case, func, select

from app.ledger import items, runs
from app.models import ItemStatus
from app.registry import ServerInfo, list_servers

# Generation latencies of reasoning models span seconds to an hour: buckets to match.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
)


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
    servers: list[ServerInfo]


def run_names(conn: Connection) -> list[str]:
    """Every run, including those without items yet."""
    return list(conn.execute(select(runs.c.name).order_by(runs.c.id)).scalars())


def item_groups(conn: Connection) -> list[ItemGroup]:
    """Item counts and completion tokens by run, server, status and finish reason."""
    stmt = (
        select(
            runs.c.name,
            items.c.server,
            items.c.status,
            items.c.finish_reason,
            func.count(),
            func.coalesce(func.sum(items.c.completion_tokens), 0),
            func.count(items.c.hedge_owner),
        )
        .select_from(items.join(runs, items.c.run_id == runs.c.id))
        .group_by(runs.c.name, items.c.server, items.c.status, items.c.finish_reason)
    )
    return [
        ItemGroup(
            run=run,
            server=server,
            status=status,
            finish_reason=finish_reason,
            items=int(count),
            completion_tokens=int(tokens),
            hedged=int(hedged),
        )
        for run, server, status, finish_reason, count, tokens, hedged in conn.execute(stmt)
    ]


def latency_histograms(
    conn: Connection, buckets_s: Sequence[float] = LATENCY_BUCKETS_S
) -> list[LatencyHistogram]:
    """Per server, a histogram of the recorded latency of items that finished with a result."""
    bounds = tuple(sorted(float(b) for b in buckets_s))
    below = [
        func.coalesce(func.sum(case((items.c.latency_s <= bound, 1), else_=0)), 0)
        for bound in bounds
    ]
    stmt = (
        select(
            items.c.server,
            func.count(items.c.latency_s),
            func.coalesce(func.sum(items.c.latency_s), 0.0),
            *below,
        )
        .where(items.c.status == ItemStatus.DONE.value, items.c.latency_s.is_not(None))
        .group_by(items.c.server)
    )
    return [
        LatencyHistogram(
            server=row[0],
            buckets_s=bounds,
            cumulative=tuple(int(n) for n in row[3:]),
            count=int(row[1]),
            sum_s=float(row[2]),
        )
        for row in conn.execute(stmt)
    ]


def read_snapshot(engine: Engine) -> LedgerSnapshot:
    """All metric queries in one read-only transaction (one snapshot on Postgres)."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
        with conn.begin():
            return LedgerSnapshot(
                run_names=run_names(conn),
                groups=item_groups(conn),
                latencies=latency_histograms(conn),
                servers=list_servers(conn),
            )
