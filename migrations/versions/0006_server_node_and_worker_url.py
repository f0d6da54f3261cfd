"""Servers: the node whose workers serve a server, and the URL those workers send to.

`url` stays the control plane's view (registered by `tokenmill servers add` or by the first
worker); a worker records its own, often loopback, URL as `worker_url` beside it.

Revision ID: 0006
Revises: 0005e
Create Date: 2026-12-01 22:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005e"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("servers") as batch:
        batch.add_column(sa.Column("worker_url", sa.Text(), nullable=True))
        batch.add_column(sa.Column("node", sa.String(200), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("servers") as batch:
        batch.drop_column("node")
        batch.drop_column("worker_url")
