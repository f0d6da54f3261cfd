"""Runs pin their storage and their servers.

- runs.storage_url: the storage URL the run's images (and compacted shards) live in, pinned
  when the run is created; every reader resolves the run's keys against it, never against its
  own TOKENMILL_STORAGE_URL. Null: a run created before 0013 (readers use their own setting).
- runs.servers: `enqueue --servers NAME...`: the registered servers that alone serve the run
  (a JSON list of names); null: any server of the fleet.
- runs.driver: "run" for a run `tokenmill run` drives (only its own `--server`s serve it; the
  fleet's reconcile and workers leave it alone); null: a fleet run (`tokenmill enqueue`).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 14:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("storage_url", sa.Text()),
    ("servers", sa.JSON()),
    ("driver", sa.String(20)),
)


def upgrade() -> None:
    # plain ADD COLUMN (no table rebuild on SQLite)
    for name, type_ in COLUMNS:
        op.add_column("runs", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    for name, _ in reversed(COLUMNS):
        op.drop_column("runs", name)
