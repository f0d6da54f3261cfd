"""A run's priority: free slots of the fleet go to the highest-priority run with items first,
and runs of one priority share them round robin (workers/engine/scheduling.py).

A plain integer column, higher first, 0 for every run created before it (they keep the order
they had between themselves: one priority, shared). `tokenmill enqueue --priority N` pins it at
creation and `tokenmill priority RUN N` changes a live run's. An ADD COLUMN with a constant
default: no table is rebuilt, on SQLite neither (the item counters' triggers stay).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07 05:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "runs",
        sa.Column("priority", sa.Integer(), nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    # a plain DROP COLUMN (SQLite 3.35+ too): a batch rebuild of runs would break the item
    # counters' triggers, which name runs
    op.drop_column("runs", "priority")
