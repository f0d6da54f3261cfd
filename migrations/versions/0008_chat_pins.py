"""Chat pins: how a run's prompts are rendered besides the template text.

`runs.chat_pins` (JSON, null for older runs) holds the transformers version the client renders
with and the server's version it renders as, the named template chosen (`--chat-template-name`),
the `--chat-template` file and its sha256, and whether turns keep every field
(`--pass-turn-fields`).

Revision ID: 0008
Revises: 0005e
Create Date: 2026-12-01 23:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# plain ALTER TABLE (SQLite has ADD and DROP COLUMN): a batch copy of runs would break the
# item-counter triggers that name it


def upgrade() -> None:
    op.add_column("runs", sa.Column("chat_pins", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "chat_pins")
