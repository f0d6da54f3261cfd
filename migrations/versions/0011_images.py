"""Images in prompts: each item's images and the token count each expanded to; each run's
image pins and the count every image of it expands to.

- items.images: the item's images in prompt order, `[{sha256, key, width, height, format,
  bytes, source}]` (app.core.images.ImageRef); null for a text item.
- items.image_token_counts: at done, how many times the server repeated each image's
  placeholder (the served prompt ids are the request ids with the i-th placeholder repeated
  counts[i] times); null for a text item.
- runs.images: the run's multimodal pins (placeholder token and id, the template's image
  text); null for a text-only run.
- run_image_tokens: per run and image (sha256), the count the first server expanded it to
  and which server that was: every server of a run must expand the same image alike.

items_archive gets the item columns too, as it holds every column of items.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 02:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ITEM_COLUMNS = (
    ("images", sa.JSON()),
    ("image_token_counts", sa.JSON()),
)


def upgrade() -> None:
    # plain ADD COLUMN (no table rebuild on SQLite): the item counters' triggers stay
    for table in ("items", "items_archive"):
        for name, type_ in ITEM_COLUMNS:
            op.add_column(table, sa.Column(name, type_, nullable=True))
    op.add_column("runs", sa.Column("images", sa.JSON(), nullable=True))
    op.create_table(
        "run_image_tokens",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("server", sa.String(200), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "sha256"),
    )


def downgrade() -> None:
    op.drop_table("run_image_tokens")
    # plain DROP COLUMN (SQLite 3.35+), again without rebuilding the tables
    op.drop_column("runs", "images")
    for table in ("items_archive", "items"):
        for name, _ in reversed(ITEM_COLUMNS):
            op.drop_column(table, name)
