"""items.fail_reason: why a failed item failed, as a short reason shared by every item failed by
the same cause (app.core.failures.failure_reason), which `status`, `verify` and `tokenmill
retry --reason` group and match by; a partial index of the failed items by run and reason.

Items that failed before this revision keep the first 160 characters of their error as their
reason. items_archive gets the column too, as it holds every column of items.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 14:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FAILED = "status = 'failed'"


def upgrade() -> None:
    # plain ADD COLUMN (no table rebuild on SQLite): the item counters' triggers stay
    for table in ("items", "items_archive"):
        op.add_column(table, sa.Column("fail_reason", sa.String(160), nullable=True))
        op.execute(
            f"UPDATE {table} SET fail_reason = coalesce(substr(error, 1, 160), "
            f"'(no error recorded)') WHERE {FAILED}"
        )
    op.create_index(
        "ix_items_failed_reason",
        "items",
        ["run_id", "fail_reason"],
        unique=False,
        postgresql_where=sa.text(FAILED),
        sqlite_where=sa.text(FAILED),
    )


def downgrade() -> None:
    op.drop_index("ix_items_failed_reason", table_name="items")
    for table in ("items_archive", "items"):
        op.drop_column(table, "fail_reason")
