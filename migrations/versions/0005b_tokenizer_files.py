"""Runs: trust_remote_code and tokenizer_files, what a run pins about its tokenizer folder.

trust_remote_code says the folder's own Python code was allowed when the run was created, so
verify, export, reports and later turns load it the same way without the flag again; it
moves out of the sampling_params JSON, where `--turns all` runs kept it. tokenizer_files is
the sha256 of every file of the folder but weights, so a changed file is named.

Revision ID: 0005b
Revises: 0005 (merged from i12-core; written on 0004)
Create Date: 2026-12-01 08:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005b"
down_revision: str | None = "0005d"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_runs = sa.table(
    "runs",
    sa.column("id", sa.BigInteger),
    sa.column("sampling_params", sa.JSON),
    sa.column("trust_remote_code", sa.Boolean),
)


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("trust_remote_code", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch_op.add_column(sa.Column("tokenizer_files", sa.JSON(), nullable=True))
    conn = op.get_bind()
    for run_id, pinned in conn.execute(sa.select(_runs.c.id, _runs.c.sampling_params)):
        if isinstance(pinned, dict) and "trust_remote_code" in pinned:
            trusted = bool(pinned.pop("trust_remote_code"))
            conn.execute(
                _runs.update()
                .where(_runs.c.id == run_id)
                .values(trust_remote_code=trusted, sampling_params=pinned)
            )


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(_runs.c.id, _runs.c.sampling_params).where(_runs.c.trust_remote_code)
    )
    for run_id, pinned in list(rows):
        conn.execute(
            _runs.update()
            .where(_runs.c.id == run_id)
            .values(sampling_params={**(pinned or {}), "trust_remote_code": True})
        )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("tokenizer_files")
        batch_op.drop_column("trust_remote_code")
