"""Runs: render_with (the server whose /v1/tokenize builds every prompt) and require_parity;
servers: parity, the last rendering check of each run against that server.

A run created with `--render-with URL` pins the URL so later enqueues and later turns render
the same way. `--require-parity` keeps a server whose rendering differs paused.

Revision ID: 0005d
Revises: 0005
Create Date: 2026-12-01 08:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005d"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("render_with", sa.Text(), nullable=True))
        batch_op.add_column(
            sa.Column("require_parity", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("servers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parity", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("servers", schema=None) as batch_op:
        batch_op.drop_column("parity")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("require_parity")
        batch_op.drop_column("render_with")
