"""Items: hedge_owner, the worker that runs a second copy of a straggling item.

When a server has free slots and its run has nothing left to claim, its worker may send an
item still running on another server to its own server too ("hedging"); the first result
written wins. hedge_owner marks the item so that at most one extra copy runs per lease.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 07:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("hedge_owner", sa.String(length=200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_column("hedge_owner")
