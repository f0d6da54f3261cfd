"""Items: the weight version and the sampling_params of each result, and a row's own
sampling_params; runs: the weight version a run is pinned to (`--weight-version`).

A result records `meta_info.weight_version` and the exact `sampling_params` body sent, so
every exported sample carries its provenance; `row_sampling_params` holds what the input row
asked for (merged over the run's when the request is built). items_archive gets the same
columns, as it holds every column of items.

Revision ID: 0007
Revises: 0005e
Create Date: 2026-12-01 22:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ITEM_COLUMNS = (
    ("weight_version", sa.String(200)),
    ("sampling_params", sa.JSON()),
    ("row_sampling_params", sa.JSON()),
)


def upgrade() -> None:
    # plain ADD COLUMN (no table rebuild on SQLite): the item counters' triggers stay
    for table in ("items", "items_archive"):
        for name, type_ in ITEM_COLUMNS:
            op.add_column(table, sa.Column(name, type_, nullable=True))
    op.add_column("runs", sa.Column("weight_version", sa.String(200), nullable=True))


def downgrade() -> None:
    # plain DROP COLUMN (SQLite 3.35+), again without rebuilding the tables
    op.drop_column("runs", "weight_version")
    for table in ("items_archive", "items"):
        for name, _ in reversed(ITEM_COLUMNS):
            op.drop_column(table, name)
