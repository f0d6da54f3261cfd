"""item_spec_stats: each done item's speculative-decoding counters from SGLang's meta_info.

spec_verify_ct, the accepted and proposed draft counts, spec_accept_length, spec_accept_rate
and the per-step histogram, one row per item (keyed by its id, no foreign key to items, so the
row survives the move to items_archive), deleted with its run.

Revision ID: 0010
Revises: 0005e
Create Date: 2026-12-01 22:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "item_spec_stats",
        sa.Column("item_id", BigId, autoincrement=False, nullable=False),
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("verify_ct", sa.Integer(), nullable=False),
        sa.Column("num_correct_drafts", sa.Integer(), nullable=False),
        sa.Column("num_proposed_drafts", sa.Integer(), nullable=False),
        sa.Column("accept_length", sa.Float(), nullable=False),
        sa.Column("accept_rate", sa.Float(), nullable=False),
        sa.Column("histogram", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("item_id"),
    )
    op.create_index("ix_item_spec_stats_run", "item_spec_stats", ["run_id", "item_id"])


def downgrade() -> None:
    op.drop_index("ix_item_spec_stats_run", table_name="item_spec_stats")
    op.drop_table("item_spec_stats")
