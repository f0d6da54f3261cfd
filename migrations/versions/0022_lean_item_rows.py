"""Leaner item writes: four indexes of items hold only the rows whose column is set, and items
keep a fifth of each page free.

An item's row is written four times (insert, queued, claimed, done) and at every lease renewal;
an update that changes an indexed column (status does) adds an entry to every index whose
predicate the new row meets. bench/fleet.py measured those entries as the largest share of the
ledger's WAL per item. ix_items_prev_item now holds the later turns of `--turns all` chains
(prev_item_id), ix_items_status_lease the leased items (lease_expires_at),
ix_items_server_status the items sent to a server (server) and ix_items_server_finished the
finished ones (finished_at): an item's insert and its updates before it gets that far add no
entry there (about 34 index entries an item down to 22). Every lookup of these indexes is by
equality or a range of that column, which implies the predicate.

items' fillfactor is 80: an update's new row mostly lands on its old row's page, where Postgres
logs only the changed middle of the row (not the prompt's ids before it again) and dirties one
page, not two.

Create Date: 2026-12-07 05:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FILLFACTOR = 80
# index → (columns, the column that must be set)
PARTIAL = {
    "ix_items_prev_item": (["prev_item_id"], "prev_item_id"),
    "ix_items_status_lease": (["status", "lease_expires_at"], "lease_expires_at"),
    "ix_items_server_status": (["server", "status"], "server"),
    "ix_items_server_finished": (["server", "finished_at"], "finished_at"),
}


def upgrade() -> None:
    for name, (columns, column) in PARTIAL.items():
        op.drop_index(name, table_name="items")
        where = sa.text(f"{column} IS NOT NULL")
        op.create_index(name, "items", columns, postgresql_where=where, sqlite_where=where)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE items SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE items RESET (fillfactor)")
    for name, (columns, _column) in PARTIAL.items():
        op.drop_index(name, table_name="items")
        op.create_index(name, "items", columns)
