"""Items: turn index and previous-turn link (multi-turn), shard pointer (compaction).

A conversation regenerated with `--turns all` has one item per assistant turn, keyed by
(run, item_key, sample, turn); a later turn waits (status "waiting") on the item of the turn
before it. A compacted item keeps its token arrays in a Parquet shard: shard_uri and
shard_row point at them, and the ledger's copies are emptied.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 04:25:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("turn_index", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("prev_item_id", BigId, nullable=True))
        batch_op.add_column(sa.Column("shard_uri", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("shard_row", sa.Integer(), nullable=True))
        batch_op.drop_constraint("uq_items_run_key_sample", type_="unique")
        batch_op.create_unique_constraint(
            "uq_items_run_key_sample_turn", ["run_id", "item_key", "sample_index", "turn_index"]
        )
        batch_op.create_index("ix_items_prev_item", ["prev_item_id"], unique=False)
        batch_op.create_foreign_key(
            "fk_items_prev_item", "items", ["prev_item_id"], ["id"], ondelete="CASCADE"
        )


def downgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_constraint("fk_items_prev_item", type_="foreignkey")
        batch_op.drop_index("ix_items_prev_item")
        batch_op.drop_constraint("uq_items_run_key_sample_turn", type_="unique")
        batch_op.create_unique_constraint(
            "uq_items_run_key_sample", ["run_id", "item_key", "sample_index"]
        )
        batch_op.drop_column("shard_row")
        batch_op.drop_column("shard_uri")
        batch_op.drop_column("prev_item_id")
        batch_op.drop_column("turn_index")
