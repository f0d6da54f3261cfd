"""A refusal that can depend on the server, confirmed on another: items.refused_by names the
server that refused the item (a 400 about length or limits, a tokenizer or vocabulary error)
while it waits for a second server's verdict; a claim by that server passes it over. Plain ADD
COLUMNs: on SQLite no table is rebuilt, so the item counters' triggers stay.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07 06:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("items", "items_archive")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("refused_by", sa.String(length=200), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        op.drop_column(table, "refused_by")
