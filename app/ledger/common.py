"""The ledger's tables and the helpers every group of its queries shares: UTC time, the
(run_id, status, id) index range, and row locks taken in id order so that writers never deadlock."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Table, and_, func, select, tuple_

# the rows of archived runs (app.ledger.archive) are items_archive: the same columns as items
from app.core.models import events, items, items_archive, runs, servers, tool_sets

__all__ = ["events", "items", "items_archive", "runs", "servers", "tool_sets"]


def run_status_range(conn: Connection, table: Table, run_id: int, status: str, after: int) -> Any:
    """WHERE for the items of one status of a run with ids above `after`, to be read ORDER BY
    run_id, status, id: one range of the (run_id, status, id) index whatever the statistics.

    On Postgres it is written `run_id = ? AND (status, id) > (?, after) AND status <= ?`.
    With plain equalities on both columns the planner treats run_id and status as constants,
    so the primary key also "delivers" the order; with stale statistics (after a big enqueue
    every item looks pending) it then walked the primary key past every other row. With
    status bounded by a row comparison the order left is (status, id), which only this index
    gives, and both bounds are index keys: the scan starts at (run, status, after) and stops
    at the end of that status. A bound written as a row comparison over run_id too,
    `(run_id, status) <= (?, ?)`, does not stop a Postgres 15 btree scan: it read every later
    index entry of the run (60 ms over 900K entries against 0.05 ms)."""
    if conn.dialect.name != "postgresql":
        return and_(table.c.run_id == run_id, table.c.status == status, table.c.id > after)
    return and_(
        table.c.run_id == run_id,
        tuple_(table.c.status, table.c.id) > tuple_(status, after),
        table.c.status <= status,
    )


# The claimable statuses, pending and queued, are exactly the statuses from CLAIMABLE_FROM to
# CLAIMABLE_TO in text order: the partial indexes of the claimable queue by kind
# (ix_items_text_claimable, ix_items_image_claimable; migration 0014) hold that range.
CLAIMABLE_FROM, CLAIMABLE_TO = "pending", "queued"


def claimable_kind_range(conn: Connection, run_id: int, status: str, *, images: bool) -> Any:
    """WHERE for one claimable status of a run, items with images (images=True) or without:
    run_status_range plus the bounds that make Postgres see it inside the predicate of
    ix_items_image_claimable (ix_items_text_claimable), so the probe reads that partial index
    (the run's claimable items of that kind only) instead of filtering the run's whole queue
    on `images`. `status >= status` beside `status <= status` keeps the order (status, id),
    as run_status_range does, while implying the index's `status >= 'pending'`."""
    kind = items.c.images.is_not(None) if images else items.c.images.is_(None)
    if conn.dialect.name != "postgresql":
        return and_(run_status_range(conn, items, run_id, status, 0), kind)
    return and_(run_status_range(conn, items, run_id, status, 0), items.c.status >= status, kind)


def run_status_order(table: Table) -> tuple[Any, ...]:
    return (table.c.run_id, table.c.status, table.c.id)


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything tokenmill stores is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def status_of_found() -> Any:
    """The status of an item row found by its id or key, to filter on: read through
    coalesce(), which no index holds, so the rows come from the ids or keys given. With the
    statistics of before an enqueue (no queued item known) a bare `status = 'queued'` was
    planned as a read of the partial index of queued items, and a statement over 32 ids read
    the whole queue."""
    return func.coalesce(items.c.status, "")


def _in_id_order(conn: Connection, ids: Sequence[int]) -> Any:
    """What an UPDATE of these ids matches, so that Postgres locks the rows in id order (a
    `SELECT … ORDER BY id FOR UPDATE` subquery). Two UPDATEs of overlapping id sets (a
    producer marking ids queued while a worker claims them) otherwise lock rows in scan
    order, which stops being id order once rows have been updated: a deadlock, and one of the
    two fails (measured: a worker lost a message that way in bench/balance.py)."""
    if conn.dialect.name != "postgresql":
        return list(ids)
    return (
        select(items.c.id).where(items.c.id.in_(list(ids))).order_by(items.c.id).with_for_update()
    )


def _lock_in_id_order(conn: Connection, ids: Sequence[int]) -> None:
    """Postgres: lock these rows in id order before a write that touches them in groups, so
    it takes its locks in the same order as claims (and never waits on a heartbeat, which
    skips locked rows)."""
    if ids and conn.dialect.name == "postgresql":
        stmt = select(items.c.id).where(items.c.id.in_(sorted(set(ids)))).order_by(items.c.id)
        conn.execute(stmt.with_for_update()).all()
