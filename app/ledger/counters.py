"""Named queries on the item counters: reading them, counting items in full, drift and repair.

Triggers on `items` (migration 0005e) keep item_counts and item_latency_counts in the same
transaction as every change of an item; views read them here in O(runs × servers × statuses).
The chain ending counters (migration 0020) are read, checked, repaired and folded here too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Table, case, delete, func, insert, select, text

from app.core.models import ItemStatus, chain_end_counts, item_counts, items, items_archive
from app.core.models import item_latency_counts as latency_counts

log = logging.getLogger(__name__)


# Generation latencies of reasoning models span seconds to an hour: buckets to match. The
# triggers of migration 0005e bucket latencies by exactly these bounds.
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

# shard 0 holds what the fold (or a repair) summed up; Postgres backends write their pid's
FOLDED_SHARD = 0
# one fold or repair at a time (a Postgres advisory lock key: "tm-counts")
_FOLD_LOCK = 0x746D_636E


@dataclass(frozen=True)
class GroupKey:
    """Items of one run that share a server, status and finish reason (None: none yet)."""

    run_id: int
    server: str | None
    status: str
    finish_reason: str | None


@dataclass(frozen=True)
class Tally:
    items: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    hedged: int = 0

    def is_zero(self) -> bool:
        return not (self.items or self.prompt_tokens or self.completion_tokens or self.hedged)


@dataclass(frozen=True)
class LatencyKey:
    """Done items of one run and server whose latency falls in one bucket (an index into
    LATENCY_BUCKETS_S; len(LATENCY_BUCKETS_S) past the last bound)."""

    run_id: int
    server: str | None
    bucket: int


@dataclass(frozen=True)
class LatencyTally:
    items: int = 0
    sum_s: float = 0.0


@dataclass(frozen=True)
class EndingKey:
    """Ended agentic chains of one run by how they ended, over items and the archive (a row
    in both tables while it is archived counts in each, as the counters count it)."""

    run_id: int
    chain_end: str


def _none_if_empty(value: str) -> str | None:
    return value or None


def _run_filter(table: Table, run_id: int | None) -> list[Any]:
    return [] if run_id is None else [table.c.run_id == run_id]


# --- reading the counters -------------------------------------------------------------------


def counted_groups(conn: Connection, run_id: int | None = None) -> dict[GroupKey, Tally]:
    """Every non-empty group of every run (or of run_id), summed over the counter shards."""
    c = item_counts.c
    stmt = (
        select(
            c.run_id,
            c.server,
            c.status,
            c.finish_reason,
            func.sum(c.item_count),
            func.sum(c.prompt_tokens),
            func.sum(c.completion_tokens),
            func.sum(c.hedged),
        )
        .where(*_run_filter(item_counts, run_id))
        .group_by(c.run_id, c.server, c.status, c.finish_reason)
    )
    out: dict[GroupKey, Tally] = {}
    for run, server, status, reason, n, prompt, completion, hedged in conn.execute(stmt):
        tally = Tally(int(n), int(prompt), int(completion), int(hedged))
        if not tally.is_zero():
            key = GroupKey(int(run), _none_if_empty(server), status, _none_if_empty(reason))
            out[key] = tally
    return out


def counted_latencies(
    conn: Connection, run_id: int | None = None
) -> dict[LatencyKey, LatencyTally]:
    """Every non-empty latency bucket of every run (or of run_id) and server."""
    c = latency_counts.c
    stmt = (
        select(c.run_id, c.server, c.bucket, func.sum(c.item_count), func.sum(c.latency_sum_s))
        .where(*_run_filter(latency_counts, run_id))
        .group_by(c.run_id, c.server, c.bucket)
    )
    return {
        LatencyKey(int(run), _none_if_empty(server), int(bucket)): LatencyTally(int(n), float(s))
        for run, server, bucket, n, s in conn.execute(stmt)
        if int(n) != 0
    }


def counted_endings(conn: Connection, run_id: int | None = None) -> dict[EndingKey, int]:
    """Every non-empty chain ending count of every run (or of run_id), summed over shards."""
    c = chain_end_counts.c
    stmt = (
        select(c.run_id, c.chain_end, func.sum(c.chain_count))
        .where(*_run_filter(chain_end_counts, run_id))
        .group_by(c.run_id, c.chain_end)
    )
    return {
        EndingKey(int(run), str(reason)): int(n)
        for run, reason, n in conn.execute(stmt)
        if int(n) != 0
    }


def by_status(groups: Iterable[tuple[GroupKey, Tally]]) -> dict[str, int]:
    """Item counts per status over these groups."""
    out: dict[str, int] = {}
    for key, tally in groups:
        out[key.status] = out.get(key.status, 0) + tally.items
    return out


def leased_by_server(conn: Connection) -> dict[str, int]:
    """Items leased right now, per server (read from the counters)."""
    c = item_counts.c
    stmt = (
        select(c.server, func.sum(c.item_count))
        .where(c.status == ItemStatus.LEASED.value, c.server != "")
        .group_by(c.server)
    )
    return {str(server): int(n) for server, n in conn.execute(stmt) if int(n) != 0}


# --- counting items in full (the check) -----------------------------------------------------


def _latency_bucket(latency: Any) -> Any:
    return case(
        *[(latency <= bound, i) for i, bound in enumerate(LATENCY_BUCKETS_S)],
        else_=len(LATENCY_BUCKETS_S),
    )


def scanned_groups(conn: Connection, run_id: int | None = None) -> dict[GroupKey, Tally]:
    """The same groups as counted_groups, counted from every item (O(items))."""
    i = items.c
    stmt = (
        select(
            i.run_id,
            i.server,
            i.status,
            i.finish_reason,
            func.count(),
            func.coalesce(func.sum(i.prompt_tokens), 0),
            func.coalesce(func.sum(i.completion_tokens), 0),
            func.count(i.hedge_owner),
        )
        .where(*_run_filter(items, run_id))
        .group_by(i.run_id, i.server, i.status, i.finish_reason)
    )
    out: dict[GroupKey, Tally] = {}
    for run, server, status, reason, n, prompt, completion, hedged in conn.execute(stmt):
        # "" and None are one key in the counters
        key = GroupKey(int(run), server or None, status, reason or None)
        old = out.get(key, Tally())
        out[key] = Tally(
            old.items + int(n),
            old.prompt_tokens + int(prompt),
            old.completion_tokens + int(completion),
            old.hedged + int(hedged),
        )
    return out


def scanned_latencies(
    conn: Connection, run_id: int | None = None
) -> dict[LatencyKey, LatencyTally]:
    """The same buckets as counted_latencies, counted from every done item (O(items))."""
    i = items.c
    bucket = _latency_bucket(i.latency_s).label("bucket")
    stmt = (
        select(i.run_id, i.server, bucket, func.count(), func.sum(i.latency_s))
        .where(
            i.status == ItemStatus.DONE.value,
            i.latency_s.is_not(None),
            *_run_filter(items, run_id),
        )
        .group_by(i.run_id, i.server, bucket)
    )
    out: dict[LatencyKey, LatencyTally] = {}
    for run, server, b, n, s in conn.execute(stmt):
        key = LatencyKey(int(run), server or None, int(b))
        old = out.get(key, LatencyTally())
        out[key] = LatencyTally(old.items + int(n), old.sum_s + float(s))
    return out


def scanned_endings(conn: Connection, run_id: int | None = None) -> dict[EndingKey, int]:
    """The same counts as counted_endings, counted from every ended row of both tables."""
    out: dict[EndingKey, int] = {}
    for table in (items, items_archive):
        t = table.c
        stmt = (
            select(t.run_id, t.chain_end, func.count())
            .where(t.chain_end.is_not(None), *_run_filter(table, run_id))
            .group_by(t.run_id, t.chain_end)
        )
        for run, reason, n in conn.execute(stmt):
            key = EndingKey(int(run), str(reason))
            out[key] = out.get(key, 0) + int(n)
    return out


@dataclass(frozen=True)
class Drift:
    """One key whose counters differ from the full count."""

    key: GroupKey | LatencyKey | EndingKey
    counted: Tally | LatencyTally | int
    scanned: Tally | LatencyTally | int

    def describe(self) -> str:
        k = self.key
        if isinstance(k, EndingKey):
            return (
                f"run {k.run_id} chain ending {k.chain_end}: counters {self.counted}, "
                f"items {self.scanned}"
            )
        if isinstance(k, GroupKey):
            where = (
                f"run {k.run_id} server {k.server or '-'} status {k.status} "
                f"finish {k.finish_reason or '-'}"
            )
        else:
            where = f"run {k.run_id} server {k.server or '-'} latency bucket {k.bucket}"
        return f"{where}: counters {self.counted}, items {self.scanned}"


def _same_latency(a: LatencyTally, b: LatencyTally) -> bool:
    # sums of floats added in another order differ in the last bits
    return a.items == b.items and math.isclose(a.sum_s, b.sum_s, rel_tol=1e-9, abs_tol=1e-6)


def find_drift(conn: Connection, run_id: int | None = None) -> list[Drift]:
    """Every key where the counters and a full count of the items disagree. Run it in one
    snapshot (REPEATABLE READ on Postgres) so that concurrent writers cannot show as drift."""
    drift: list[Drift] = []
    counted, scanned = counted_groups(conn, run_id), scanned_groups(conn, run_id)
    for key in sorted(set(counted) | set(scanned), key=repr):
        a, b = counted.get(key, Tally()), scanned.get(key, Tally())
        if a != b:
            drift.append(Drift(key, a, b))
    lat_counted, lat_scanned = counted_latencies(conn, run_id), scanned_latencies(conn, run_id)
    for lkey in sorted(set(lat_counted) | set(lat_scanned), key=repr):
        la, lb = lat_counted.get(lkey, LatencyTally()), lat_scanned.get(lkey, LatencyTally())
        if not _same_latency(la, lb):
            drift.append(Drift(lkey, la, lb))
    ends_counted, ends_scanned = counted_endings(conn, run_id), scanned_endings(conn, run_id)
    for ekey in sorted(set(ends_counted) | set(ends_scanned), key=repr):
        ea, eb = ends_counted.get(ekey, 0), ends_scanned.get(ekey, 0)
        if ea != eb:
            drift.append(Drift(ekey, ea, eb))
    return drift


# --- repair and fold -----------------------------------------------------------------------


def repair(conn: Connection, run_id: int | None = None) -> None:
    """Replace the counters of run_id (or of every run) with a full count of its items.
    On Postgres, writers of items wait for it (SHARE lock), so no change is lost between the
    count and the replacement; call it inside a transaction."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _FOLD_LOCK})
        conn.execute(text("LOCK TABLE items, items_archive IN SHARE MODE"))
    # on SQLite the first delete takes the write lock, before the count
    conn.execute(delete(item_counts).where(*_run_filter(item_counts, run_id)))
    conn.execute(delete(latency_counts).where(*_run_filter(latency_counts, run_id)))
    conn.execute(delete(chain_end_counts).where(*_run_filter(chain_end_counts, run_id)))
    groups = [
        {
            "run_id": k.run_id,
            "server": k.server or "",
            "status": k.status,
            "finish_reason": k.finish_reason or "",
            "shard": FOLDED_SHARD,
            "item_count": t.items,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "hedged": t.hedged,
        }
        for k, t in scanned_groups(conn, run_id).items()
    ]
    if groups:
        conn.execute(insert(item_counts), groups)
    buckets = [
        {
            "run_id": k.run_id,
            "server": k.server or "",
            "bucket": k.bucket,
            "shard": FOLDED_SHARD,
            "item_count": t.items,
            "latency_sum_s": t.sum_s,
        }
        for k, t in scanned_latencies(conn, run_id).items()
    ]
    if buckets:
        conn.execute(insert(latency_counts), buckets)
    endings = [
        {"run_id": k.run_id, "chain_end": k.chain_end, "shard": FOLDED_SHARD, "chain_count": n}
        for k, n in scanned_endings(conn, run_id).items()
    ]
    if endings:
        conn.execute(insert(chain_end_counts), endings)
    log.info(
        "item counters of %s replaced by a full count",
        "every run" if run_id is None else f"run {run_id}",
        extra={"action": "counters_recounted"},
    )


_PG_FOLD_COUNTS = """
WITH picked AS (
    SELECT run_id, server, status, finish_reason, shard FROM item_counts
    WHERE shard <> 0 FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM item_counts c USING picked p
    WHERE c.run_id = p.run_id AND c.server = p.server AND c.status = p.status
      AND c.finish_reason = p.finish_reason AND c.shard = p.shard
    RETURNING c.*
)
INSERT INTO item_counts AS t
    (run_id, server, status, finish_reason, shard,
     item_count, prompt_tokens, completion_tokens, hedged)
SELECT run_id, server, status, finish_reason, 0,
       sum(item_count), sum(prompt_tokens), sum(completion_tokens), sum(hedged)
FROM moved GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4
ON CONFLICT (run_id, server, status, finish_reason, shard) DO UPDATE SET
    item_count = t.item_count + excluded.item_count,
    prompt_tokens = t.prompt_tokens + excluded.prompt_tokens,
    completion_tokens = t.completion_tokens + excluded.completion_tokens,
    hedged = t.hedged + excluded.hedged
"""

_PG_FOLD_LATENCY = """
WITH picked AS (
    SELECT run_id, server, bucket, shard FROM item_latency_counts
    WHERE shard <> 0 FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM item_latency_counts c USING picked p
    WHERE c.run_id = p.run_id AND c.server = p.server AND c.bucket = p.bucket
      AND c.shard = p.shard
    RETURNING c.*
)
INSERT INTO item_latency_counts AS t
    (run_id, server, bucket, shard, item_count, latency_sum_s)
SELECT run_id, server, bucket, 0, sum(item_count), sum(latency_sum_s)
FROM moved GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
ON CONFLICT (run_id, server, bucket, shard) DO UPDATE SET
    item_count = t.item_count + excluded.item_count,
    latency_sum_s = t.latency_sum_s + excluded.latency_sum_s
"""

_PG_FOLD_CHAIN_ENDS = """
WITH picked AS (
    SELECT run_id, chain_end, shard FROM chain_end_counts
    WHERE shard <> 0 FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM chain_end_counts c USING picked p
    WHERE c.run_id = p.run_id AND c.chain_end = p.chain_end AND c.shard = p.shard
    RETURNING c.*
)
INSERT INTO chain_end_counts AS t (run_id, chain_end, shard, chain_count)
SELECT run_id, chain_end, 0, sum(chain_count)
FROM moved GROUP BY 1, 2 ORDER BY 1, 2
ON CONFLICT (run_id, chain_end, shard) DO UPDATE SET
    chain_count = t.chain_count + excluded.chain_count
"""


def fold_shards(conn: Connection) -> bool:
    """Sum the writers' shards into shard 0 and drop empty rows, so reads stay small (the item
    counters and the chain ending counters). Rows a writer holds right now are skipped (next
    time), so no writer ever waits for a fold. False when another fold or repair was running
    (nothing done)."""
    if conn.dialect.name == "postgresql":
        locked = conn.execute(text("SELECT pg_try_advisory_xact_lock(:key)"), {"key": _FOLD_LOCK})
        if not locked.scalar_one():
            return False
        conn.execute(text(_PG_FOLD_COUNTS))
        conn.execute(text(_PG_FOLD_LATENCY))
        conn.execute(text(_PG_FOLD_CHAIN_ENDS))
    c, lc, ec = item_counts.c, latency_counts.c, chain_end_counts.c
    conn.execute(
        delete(item_counts).where(
            c.shard == FOLDED_SHARD,
            c.item_count == 0,
            c.prompt_tokens == 0,
            c.completion_tokens == 0,
            c.hedged == 0,
        )
    )
    conn.execute(delete(latency_counts).where(lc.shard == FOLDED_SHARD, lc.item_count == 0))
    conn.execute(delete(chain_end_counts).where(ec.shard == FOLDED_SHARD, ec.chain_count == 0))
    return True


def check(engine: Engine, run_id: int | None = None, *, repair_drift: bool = False) -> list[Drift]:
    """The drift between the counters of run_id (or every run) and a full count, read in one
    snapshot; with repair_drift, counters that drifted are then replaced by a full count."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn = conn.execution_options(
                isolation_level="REPEATABLE READ", postgresql_readonly=True
            )
        with conn.begin():
            drift = find_drift(conn, run_id)
    if drift and repair_drift:
        with engine.begin() as conn:
            repair(conn, run_id)
    return drift


def claimable_by_run(conn: Connection) -> dict[int, int]:
    """run id → its items waiting for a worker (pending or queued), for runs that have any:
    the counters' rows of two statuses, summed over their shards (a worker's claim order
    reads it every few seconds, so never the items themselves)."""
    c = item_counts.c
    stmt = (
        select(c.run_id, func.sum(c.item_count))
        .where(c.status.in_((ItemStatus.PENDING.value, ItemStatus.QUEUED.value)))
        .group_by(c.run_id)
    )
    return {int(run): int(n) for run, n in conn.execute(stmt) if n and int(n) > 0}
