"""Agentic chains' endings as counters, and the last turns whose ending is still to be recorded.

chain_end_counts holds each run's chains by how they ended, over items and items_archive, so
`status` and the export manifest read O(reasons) rows instead of counting the ended chains.
Triggers on both tables keep it in the same transaction as every change of chain_end, insert
and delete of a row that has one, whoever the writer is: on Postgres a row trigger on
`UPDATE OF chain_end` (only the statement recording an ending names that column) and
statement-level insert and delete triggers over the transition tables, each writing the shard
of its backend as the item counters do; on SQLite row triggers on shard 0. A row being
archived is in both tables and counted twice until its hot copy goes: readers count such a
run's endings from its rows (app.ledger.reads.chain_endings).

items.ends_chain (and items_archive's) marks the last turn of an agentic chain at enqueue;
ix_items_unended holds the done ones with no ending recorded, so reconcile's catch-up reads
the rows it fixes, not the run's done items. The migration backfills the counters and marks the
unended last turns of existing agentic runs (every chain of such a run: the catch-up clears
the mark of a chain it finds plain). The columns are plain ADD COLUMNs: on SQLite no table is
rebuilt, so the item counters' triggers stay.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03 15:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
TABLES = ("items", "items_archive")
UNENDED_PG = "ends_chain AND status = 'done' AND chain_end IS NULL"
UNENDED_SQLITE = "ends_chain = 1 AND status = 'done' AND chain_end IS NULL"

_UPSERT = """
    INSERT INTO chain_end_counts AS t (run_id, chain_end, shard, chain_count)
    {select}
    ON CONFLICT (run_id, chain_end, shard) DO UPDATE SET
        chain_count = t.chain_count + excluded.chain_count;"""


def _pg_rows(rows: str, sign: str) -> str:
    """The ended chains of a transition table, as one upsert per (run, reason)."""
    select = (
        f"SELECT a.run_id, a.chain_end, pg_backend_pid(), {sign}count(*) FROM {rows} a "
        "WHERE a.chain_end IS NOT NULL AND EXISTS (SELECT 1 FROM runs r WHERE r.id = a.run_id) "
        "GROUP BY a.run_id, a.chain_end ORDER BY 1, 2"
    )
    return _UPSERT.format(select=select)


def _pg_row(row: str, sign: str) -> str:
    select = (
        f"SELECT {row}.run_id, {row}.chain_end, pg_backend_pid(), {sign}1 "
        f"WHERE EXISTS (SELECT 1 FROM runs r WHERE r.id = {row}.run_id)"
    )
    return f"  IF {row}.chain_end IS NOT NULL THEN{_UPSERT.format(select=select)}\n  END IF;"


_PG_FUNCTIONS = (
    "CREATE FUNCTION tm_chain_ends_counted() RETURNS trigger LANGUAGE plpgsql AS $$\nBEGIN\n"
    f"  IF TG_OP = 'INSERT' THEN{_pg_rows('new_rows', '')}\n"
    f"  ELSE{_pg_rows('old_rows', '-')}\n  END IF;\n  RETURN NULL;\nEND\n$$",
    "CREATE FUNCTION tm_chain_end_changed() RETURNS trigger LANGUAGE plpgsql AS $$\nBEGIN\n"
    f"{_pg_row('OLD', '-')}\n{_pg_row('NEW', '')}\n  RETURN NULL;\nEND\n$$",
)


def _pg_triggers(table: str) -> list[str]:
    return [
        f"CREATE TRIGGER tm_{table}_chain_ends_insert AFTER INSERT ON {table} "
        "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
        "EXECUTE FUNCTION tm_chain_ends_counted()",
        f"CREATE TRIGGER tm_{table}_chain_ends_delete AFTER DELETE ON {table} "
        "REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT "
        "EXECUTE FUNCTION tm_chain_ends_counted()",
        f"CREATE TRIGGER tm_{table}_chain_end_update AFTER UPDATE OF chain_end, run_id "
        f"ON {table} FOR EACH ROW WHEN (OLD.chain_end IS DISTINCT FROM NEW.chain_end "
        "OR OLD.run_id IS DISTINCT FROM NEW.run_id) EXECUTE FUNCTION tm_chain_end_changed()",
    ]


def _sqlite_row(row: str, sign: str) -> str:
    select = (
        f"SELECT {row}.run_id, {row}.chain_end, 0, {sign}1 WHERE {row}.chain_end IS NOT NULL "
        f"AND EXISTS (SELECT 1 FROM runs r WHERE r.id = {row}.run_id)"
    )
    # SQLite's upsert names the target's columns without the alias
    return (
        _UPSERT.format(select=select).replace(" AS t", "").replace("t.chain_count", "chain_count")
    )


def _sqlite_triggers(table: str) -> list[str]:
    return [
        f"CREATE TRIGGER tm_{table}_chain_ends_insert AFTER INSERT ON {table} "
        f"WHEN NEW.chain_end IS NOT NULL BEGIN{_sqlite_row('NEW', '')}\nEND",
        f"CREATE TRIGGER tm_{table}_chain_ends_delete AFTER DELETE ON {table} "
        f"WHEN OLD.chain_end IS NOT NULL BEGIN{_sqlite_row('OLD', '-')}\nEND",
        f"CREATE TRIGGER tm_{table}_chain_end_update AFTER UPDATE OF chain_end, run_id "
        f"ON {table} WHEN OLD.chain_end IS NOT NEW.chain_end OR OLD.run_id IS NOT NEW.run_id "
        f"BEGIN{_sqlite_row('OLD', '-')}{_sqlite_row('NEW', '')}\nEND",
    ]


_BACKFILL_COUNTS = """
INSERT INTO chain_end_counts (run_id, chain_end, shard, chain_count)
SELECT run_id, chain_end, 0, count(*) FROM (
    SELECT run_id, chain_end FROM items WHERE chain_end IS NOT NULL
    UNION ALL
    SELECT run_id, chain_end FROM items_archive WHERE chain_end IS NOT NULL
) ended GROUP BY run_id, chain_end"""

_MARK_LAST_TURNS = """
UPDATE items SET ends_chain = true
WHERE chain_end IS NULL
  AND run_id IN (SELECT id FROM runs WHERE {turns} = 'all' AND {parser} IS NOT NULL)
  AND NOT EXISTS (SELECT 1 FROM items later WHERE later.prev_item_id = items.id)"""


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("ends_chain", sa.Boolean(), nullable=True))
    op.create_table(
        "chain_end_counts",
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("chain_end", sa.String(length=32), nullable=False),
        sa.Column("shard", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("chain_count", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "chain_end", "shard"),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        # writers wait while the triggers are created and the counters filled, so that no
        # ending falls between the backfill and the first trigger
        op.execute("LOCK TABLE items, items_archive IN SHARE MODE")
        op.execute(
            "ALTER TABLE chain_end_counts SET (fillfactor = 50, "
            "autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000)"
        )
        for statement in _PG_FUNCTIONS:
            op.execute(statement)
        for table in TABLES:
            for statement in _pg_triggers(table):
                op.execute(statement)
        turns, parser = "(sampling_params ->> 'turns')", "(chat_pins ->> 'tool_call_parser')"
    else:
        for table in TABLES:
            for statement in _sqlite_triggers(table):
                op.execute(statement)
        turns = "json_extract(sampling_params, '$.turns')"
        parser = "json_extract(chat_pins, '$.tool_call_parser')"
    op.execute(_BACKFILL_COUNTS)
    op.execute(_MARK_LAST_TURNS.format(turns=turns, parser=parser))
    op.create_index(
        "ix_items_unended",
        "items",
        ["run_id", "id"],
        unique=False,
        postgresql_where=sa.text(UNENDED_PG),
        sqlite_where=sa.text(UNENDED_SQLITE),
    )


def downgrade() -> None:
    op.drop_index("ix_items_unended", table_name="items")
    postgres = op.get_bind().dialect.name == "postgresql"
    for table in TABLES:
        for name in ("chain_ends_insert", "chain_ends_delete", "chain_end_update"):
            op.execute(
                f"DROP TRIGGER IF EXISTS tm_{table}_{name}" + (f" ON {table}" if postgres else "")
            )
    if postgres:
        op.execute("DROP FUNCTION IF EXISTS tm_chain_ends_counted()")
        op.execute("DROP FUNCTION IF EXISTS tm_chain_end_changed()")
    op.drop_table("chain_end_counts")
    for table in reversed(TABLES):
        op.drop_column(table, "ends_chain")
