"""When each worker last read its server's load (`/v1/loads`): `servers` ages a reading that
has gone stale (the server stopped answering it) instead of showing it as now.

Create Date: 2026-12-07 05:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "server_windows", sa.Column("loads_at", sa.DateTime(timezone=True), nullable=True)
    )


def downgrade() -> None:
    with op.batch_alter_table("server_windows") as batch:
        batch.drop_column("loads_at")
