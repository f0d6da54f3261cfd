"""items.assistant_prefix: the final assistant turn's text of a row whose continue_final_message
was applied to the item (SGLang appends it after the generation prompt), so verify re-renders the
prompt and export records it; null for every other item. items_archive gets the column too.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03 12:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMN (no table rebuild on SQLite): the item counters' triggers stay
    for table in ("items", "items_archive"):
        op.add_column(table, sa.Column("assistant_prefix", sa.Text(), nullable=True))


def downgrade() -> None:
    for table in ("items_archive", "items"):
        op.drop_column(table, "assistant_prefix")
