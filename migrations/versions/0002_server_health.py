"""Servers: state_since, paused_by, last probe result; items indexed by server.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 02:02:17.134464
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.create_index("ix_items_server_finished", ["server", "finished_at"], unique=False)
        batch_op.create_index("ix_items_server_status", ["server", "status"], unique=False)

    with op.batch_alter_table("servers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state_since", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("paused_by", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("last_probe_ok", sa.Boolean(), nullable=True))
        batch_op.add_column(sa.Column("last_probe_latency_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("servers", schema=None) as batch_op:
        batch_op.drop_column("last_probe_latency_s")
        batch_op.drop_column("last_probe_ok")
        batch_op.drop_column("paused_by")
        batch_op.drop_column("state_since")

    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_index("ix_items_server_status")
        batch_op.drop_index("ix_items_server_finished")
