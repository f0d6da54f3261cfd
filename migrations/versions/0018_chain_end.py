"""items.chain_end: how an on-policy agentic chain (`--turns all` on rows with tool turns) ended,
on the last turn it kept: complete, or the first mismatch with the dataset's cached tool results
(app.core.constants CHAIN_END_*). items_archive gets the column too.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03 11:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ENDED = "chain_end IS NOT NULL"


def upgrade() -> None:
    # plain ADD COLUMN (no table rebuild on SQLite): the item counters' triggers stay
    for table in ("items", "items_archive"):
        op.add_column(table, sa.Column("chain_end", sa.String(32), nullable=True))
    op.create_index(
        "ix_items_chain_end",
        "items",
        ["run_id", "chain_end"],
        unique=False,
        postgresql_where=sa.text(ENDED),
        sqlite_where=sa.text(ENDED),
    )


def downgrade() -> None:
    op.drop_index("ix_items_chain_end", table_name="items")
    for table in ("items_archive", "items"):
        op.drop_column(table, "chain_end")
