"""Deleting a run (`tokenmill delete`): its items, archived items, tool sets, events, counters
and the servers' parity results for it, the items in pages so no statement holds the whole run.

The caller decides whether work in flight may be dropped (RunCounts says what is leased).
"""

from __future__ import annotations

from sqlalchemy import Connection, delete, select, update

from app.ledger import common

# items deleted per statement: the counter triggers run once per row
DELETE_PAGE_ITEMS = 5_000


def delete_items_page(conn: Connection, run_id: int, *, limit: int = DELETE_PAGE_ITEMS) -> int:
    """Delete up to limit of the run's items (the hot table first, then the archive); return
    how many went. Later turns of a deleted item go with it (their foreign key cascades)."""
    for table in (common.items, common.items_archive):
        pick = select(table.c.id).where(table.c.run_id == run_id).order_by(table.c.id)
        ids = list(conn.execute(pick.limit(limit)).scalars())
        if ids:
            result = conn.execute(delete(table).where(table.c.id.in_(ids)))
            return max(int(result.rowcount), len(ids))
    return 0


def delete_run_row(conn: Connection, run_id: int, name: str) -> None:
    """Delete the run itself, with what still refers to it (its events, tool sets and item
    counters cascade), and forget the servers' parity results for its name (a new run of
    that name starts unchecked)."""
    for row in conn.execute(select(common.servers.c.name, common.servers.c.parity)).all():
        if row.parity and name in row.parity:
            parity = {k: v for k, v in row.parity.items() if k != name}
            conn.execute(
                update(common.servers)
                .where(common.servers.c.name == row.name)
                .values(parity=parity or None, updated_at=common.utcnow())
            )
    conn.execute(delete(common.runs).where(common.runs.c.id == run_id))
