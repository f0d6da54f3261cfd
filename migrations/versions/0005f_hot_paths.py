"""Items: indexes for the hot and periodic paths, per-table autovacuum, and the archive table.

The keyset pages of one status of a run read (run_id, status, id) in order. Partial indexes
hold only the active rows the periodic queries look at (leased, queued, done and not yet
compacted, and the latest completion of each server), so their plans do not depend on the
planner's statistics. On Postgres, items is vacuumed and analyzed after a small share of it
changed. A finished, compacted run's rows can be moved to items_archive (same columns), and
runs.archived_at marks such a run, and runs.archived_counts keeps its counts (the item counters
follow the rows of items).

Revision ID: 0005f
Revises: 0004
Create Date: 2026-12-01 08:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005f"
down_revision: str | None = "0005b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

PARTIAL = (
    ("ix_items_leased_started", ["started_at", "id"], "status = 'leased'"),
    ("ix_items_queued_at", ["queued_at", "id"], "status = 'queued'"),
    ("ix_items_done_finished", ["server", "finished_at"], "status = 'done'"),
    ("ix_items_uncompacted", ["run_id", "id"], "status = 'done' AND shard_uri IS NULL"),
)
# about 1% of a 10M-row table changed starts an autoanalyze (the default is 10%: a million
# rows), 2% a vacuum; the thresholds keep a small table from being analyzed on every beat
AUTOVACUUM = {
    "autovacuum_vacuum_scale_factor": "0.02",
    "autovacuum_vacuum_threshold": "5000",
    "autovacuum_vacuum_insert_scale_factor": "0.02",
    "autovacuum_vacuum_insert_threshold": "10000",
    "autovacuum_analyze_scale_factor": "0.01",
    "autovacuum_analyze_threshold": "5000",
}


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("archived_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("archived_counts", sa.JSON(), nullable=True))
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_index("ix_items_run_status")
        batch_op.create_index("ix_items_run_status_id", ["run_id", "status", "id"], unique=False)
    for name, columns, where in PARTIAL:
        op.create_index(
            name,
            "items",
            columns,
            unique=False,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )
    op.create_table(
        "items_archive",
        sa.Column("id", BigId, autoincrement=False, nullable=False),
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("item_key", sa.String(length=200), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("turn_index", sa.Integer(), nullable=False),
        sa.Column("prev_item_id", BigId, nullable=True),
        sa.Column("line_no", sa.Integer(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("server", sa.String(length=200), nullable=True),
        sa.Column("hedge_owner", sa.String(length=200), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("output_ids", sa.LargeBinary(), nullable=True),
        sa.Column("finish_reason", sa.String(length=16), nullable=True),
        sa.Column("matched_stop", sa.String(length=64), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("latency_s", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("shard_uri", sa.Text(), nullable=True),
        sa.Column("shard_row", sa.Integer(), nullable=True),
        sa.Column("tool_set_id", BigId, nullable=True),
        sa.Column("chat_template_kwargs", sa.JSON(), nullable=True),
        sa.Column("row_metadata", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_items_archive_run_status_id",
        "items_archive",
        ["run_id", "status", "id"],
        unique=False,
    )
    op.create_index("ix_items_archive_prev_item", "items_archive", ["prev_item_id"], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        settings = ", ".join(f"{k} = {v}" for k, v in AUTOVACUUM.items())
        op.execute(f"ALTER TABLE items SET ({settings})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE items RESET ({', '.join(AUTOVACUUM)})")
    op.drop_index("ix_items_archive_prev_item", table_name="items_archive")
    op.drop_index("ix_items_archive_run_status_id", table_name="items_archive")
    op.drop_table("items_archive")
    for name, _columns, _where in PARTIAL:
        op.drop_index(name, table_name="items")
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_index("ix_items_run_status_id")
        batch_op.create_index("ix_items_run_status", ["run_id", "status"], unique=False)
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("archived_counts")
        batch_op.drop_column("archived_at")
