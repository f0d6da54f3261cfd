"""The archive's failed items by reason: `status` counts an archived run's failures by reason
through this partial index, as it counts the hot table's through ix_items_failed_reason.

Without it the count read the run's failed archived rows through (run_id, status, id) and
sorted them to group them; the index holds the failed rows alone, ordered by reason, so the
count is one ordered range of index entries whatever the planner's statistics say.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03 12:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FAILED = "status = 'failed'"


def upgrade() -> None:
    op.create_index(
        "ix_items_archive_failed_reason",
        "items_archive",
        ["run_id", "fail_reason"],
        unique=False,
        postgresql_where=sa.text(FAILED),
        sqlite_where=sa.text(FAILED),
    )


def downgrade() -> None:
    op.drop_index("ix_items_archive_failed_reason", table_name="items_archive")
