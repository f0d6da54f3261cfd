"""The auto-sized windows: per server and worker (lease owner), the window it keeps in flight,
the server's capacity and last load reading it sized by, and why it last changed.

Revision ID: 0016
Revises: 0014
Create Date: 2026-12-02 14:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "server_windows",
        sa.Column("server", sa.String(200), nullable=False),
        sa.Column("owner", sa.String(300), nullable=False),
        sa.Column("mode", sa.String(8), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("max_running", sa.Integer(), nullable=True),
        sa.Column("max_total_tokens", sa.BigInteger(), nullable=True),
        sa.Column("running", sa.Integer(), nullable=True),
        sa.Column("queued", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("server", "owner"),
    )


def downgrade() -> None:
    op.drop_table("server_windows")
