"""A run's kind: what its items are for (app.core.run_kinds.RunKind; the policy of each kind
is workers/engine/policies.py). Every run before this one generates: it reads 'generate'.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07 05:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # plain ADD COLUMN (no table rebuild on SQLite); the default fills the existing rows
    op.add_column(
        "runs", sa.Column("kind", sa.String(20), nullable=False, server_default="generate")
    )


def downgrade() -> None:
    op.drop_column("runs", "kind")
