"""Chat inputs: the normalization version a run pins, and what else built each prompt.

A run records the message-normalization rules its prompts are built with
(`app.prompts.chat_path.NORMALIZATION_VERSION`; null for older runs). An item keeps its row's tools
(a run's distinct tools lists live once in tool_sets), its template kwargs merged over the
run's (null: the run's own), and the row's other fields as metadata, exported with it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 08:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("normalization_version", sa.String(length=40), nullable=True))
    op.create_table(
        "tool_sets",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("tools_hash", sa.String(length=64), nullable=False),
        sa.Column("tools", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "tools_hash", name="uq_tool_sets_run_hash"),
    )
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tool_set_id", BigId, nullable=True))
        batch_op.add_column(sa.Column("chat_template_kwargs", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("row_metadata", sa.JSON(), nullable=True))
        batch_op.create_foreign_key(
            "fk_items_tool_set", "tool_sets", ["tool_set_id"], ["id"], ondelete="CASCADE"
        )


def downgrade() -> None:
    with op.batch_alter_table("items", schema=None) as batch_op:
        batch_op.drop_constraint("fk_items_tool_set", type_="foreignkey")
        batch_op.drop_column("row_metadata")
        batch_op.drop_column("chat_template_kwargs")
        batch_op.drop_column("tool_set_id")
    op.drop_table("tool_sets")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("normalization_version")
