"""Compaction's queries: the done items whose token arrays may move to Parquet shards, marking
them moved, and which shards the ledger still points at."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, bindparam, func, select, text, update

from app.core.models import ItemStatus, pack_ids
from app.ledger import common, database, run_queries


def _compactable(run_id: int) -> Any:
    """Done items of the run whose arrays are still in the ledger and that no unfinished later
    turn still reads (a multi-turn chain builds the next prompt from the previous turn)."""
    later = common.items.alias("later")
    depended_on = (
        select(later.c.id)
        .where(
            later.c.prev_item_id == common.items.c.id,
            # the predicate of ix_items_prev_unfinished, the later turns still to run: the
            # anti-join reads that index, not every item's prev_item_id
            later.c.prev_item_id.is_not(None),
            later.c.status != ItemStatus.DONE.value,
            later.c.status != ItemStatus.FAILED.value,
        )
        .exists()
    )
    return and_(
        common.items.c.run_id == run_id,
        common.items.c.status == ItemStatus.DONE.value,
        common.items.c.shard_uri.is_(None),
        ~depended_on,
    )


def count_compactable(conn: Connection, run_id: int) -> int:
    """How many of the run's items compaction may move (an exact count: `compact --all`)."""
    database.pin_index_plans(conn)
    return int(conn.execute(select(func.count()).where(_compactable(run_id))).scalar_one())


def count_uncompacted(conn: Connection, run_id: int, *, at_most: int) -> int:
    """The run's finished items whose arrays are still in the ledger, counted up to at_most:
    one range of ix_items_uncompacted, index entries only, so the periodic "are there
    enough?" costs the same at 10M items as at 10K. (Compaction itself still leaves out the
    items a waiting later turn reads.)"""
    database.pin_index_plans(conn)
    found = (
        select(common.items.c.id)
        .where(
            common.items.c.run_id == run_id,
            common.items.c.status == ItemStatus.DONE.value,
            common.items.c.shard_uri.is_(None),
        )
        .order_by(common.items.c.run_id, common.items.c.id)
        .limit(at_most)
    )
    return int(conn.execute(select(func.count()).select_from(found.subquery())).scalar_one())


def compactable_ids(conn: Connection, run_id: int, *, after_id: int = 0, limit: int) -> list[int]:
    """Ids of items compaction may move, in id order."""
    database.pin_index_plans(conn)
    stmt = (
        select(common.items.c.id)
        .where(_compactable(run_id), common.items.c.id > after_id)
        .order_by(common.items.c.id)
        .limit(limit)
    )
    return list(conn.execute(stmt).scalars())


MARK_ROWS = 100  # items a statement of mark_compacted points at their shard
_COMPACTED_TOGETHER = text(
    """
UPDATE items SET shard_uri = :uri, shard_row = v.shard_row, prompt_ids = :empty,
    output_ids = :empty
FROM unnest(CAST(:ids AS bigint[]), CAST(:rows AS integer[])) AS v(id, shard_row)
WHERE items.id = v.id AND items.shard_uri IS NULL AND items.status = 'done'
"""
)


def mark_compacted(conn: Connection, shard_uri: str, rows: Sequence[tuple[int, int]]) -> int:
    """Point items at (shard_uri, row) and empty their ledger arrays, for (item id, row) pairs;
    items already compacted are left alone. Returns how many were changed."""
    if not rows:
        return 0
    if conn.dialect.name == "postgresql":
        # statements of MARK_ROWS, not one per item (the counting trigger of migration 0005e
        # runs once a statement) nor one per shard: a shard's 50,000 rows in one UPDATE took
        # 2-6 s with workers beside it, and slowed their claims and writes meanwhile; 1,000
        # rows took 0.1-0.34 s beside a worker at 1M items (133 such statements in 8 min)
        changed = 0
        for start in range(0, len(rows), MARK_ROWS):
            chunk = rows[start : start + MARK_ROWS]
            together = conn.execute(
                _COMPACTED_TOGETHER,
                {
                    "uri": shard_uri,
                    "ids": [item_id for item_id, _ in chunk],
                    "rows": [row for _, row in chunk],
                    "empty": pack_ids([]),
                },
            )
            changed += int(together.rowcount)
        return changed
    stmt = (
        update(common.items)
        .where(
            common.items.c.id == bindparam("b_id"),
            common.items.c.shard_uri.is_(None),
            common.items.c.status == ItemStatus.DONE.value,
        )
        .values(
            shard_uri=shard_uri,
            shard_row=bindparam("b_row"),
            prompt_ids=[],
            output_ids=[],
        )
    )
    result = conn.execute(stmt, [{"b_id": item_id, "b_row": row} for item_id, row in rows])
    return int(result.rowcount)


def shard_referenced(conn: Connection, run_id: int, name: str, first_id: int, last_id: int) -> bool:
    """Whether an item of the run (in items or the archive) points at the shard `name`, which
    holds items first_id..last_id: a primary-key range probe that stops at the first match
    (normally first_id itself), never a scan of the run."""
    for table in (common.items, common.items_archive):
        probe = select(table.c.id).where(
            table.c.id >= first_id,
            table.c.id <= last_id,
            table.c.run_id == run_id,
            table.c.shard_uri.endswith("/" + name, autoescape=True),
        )
        if conn.execute(probe.order_by(table.c.id).limit(1)).first() is not None:
            return True
    return False


def shard_uris(conn: Connection, run_id: int) -> set[str]:
    """Every shard the run's items point at."""
    stmt = select(common.items.c.shard_uri).where(
        common.items.c.run_id == run_id, common.items.c.shard_uri.is_not(None)
    )
    return {str(u) for u in conn.execute(stmt.distinct()).scalars()}


def compacted_count(conn: Connection, run_id: int) -> int:
    stmt = select(func.count()).where(
        common.items.c.run_id == run_id, common.items.c.shard_uri.is_not(None)
    )
    return int(conn.execute(stmt).scalar_one())


def runs_with_compactable(conn: Connection, min_items: int) -> list[run_queries.RunInfo]:
    """Runs with at least min_items finished items whose arrays are still in the ledger: per
    run, count_uncompacted up to min_items (O(runs x min_items), never a count of every
    finished row)."""
    run_ids = conn.execute(select(common.runs.c.id).order_by(common.runs.c.id)).scalars().all()
    return [
        run_queries.get_run_by_id(conn, int(run_id))
        for run_id in run_ids
        if count_uncompacted(conn, int(run_id), at_most=min_items) >= min_items
    ]
