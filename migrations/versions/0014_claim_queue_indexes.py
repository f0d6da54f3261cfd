"""Items: the claimable queue of a run split by images, so "is there a text item (an image
item) to claim?" is one index probe, and the later turns still to run.

A server that reads no images claims text items only, and `status` warns when image items
wait for a server that reads them. Both asked "is there a queued item without (with) images?"
of the (run_id, status, id) index and filtered on `images`: with a million queued text items
and no image item, the image question read every queued row to find none. Each partial index
holds only the claimable (pending or queued) items of one kind, so the probe's first entry
answers it, whatever the statistics say; a claim moves its items out of both.

Compaction keeps the done items an unfinished later turn still builds on: its anti-join now
reads ix_items_prev_unfinished (the later turns still to run) instead of the prev_item_id of
every item (150,000 index entries read for a run of 150,000 single-turn items).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 15:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# pending and queued, written as the range of statuses they are (in text order) so that a
# probe's `status >= 'queued' AND status <= 'queued'` falls inside it
CLAIMABLE = "status >= 'pending' AND status <= 'queued'"
PARTIAL = (
    ("ix_items_text_claimable", ["run_id", "status", "id"], f"images IS NULL AND {CLAIMABLE}"),
    ("ix_items_image_claimable", ["run_id", "status", "id"], f"images IS NOT NULL AND {CLAIMABLE}"),
    (
        "ix_items_prev_unfinished",
        ["prev_item_id"],
        "prev_item_id IS NOT NULL AND status <> 'done' AND status <> 'failed'",
    ),
)


def upgrade() -> None:
    for name, columns, where in PARTIAL:
        op.create_index(
            name,
            "items",
            columns,
            unique=False,
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def downgrade() -> None:
    for name, _, _ in reversed(PARTIAL):
        op.drop_index(name, table_name="items")
