"""The ledger's tables as typed SQLAlchemy 2.0 models: runs, items, servers, events, counters.

The schema is changed only by Alembic migrations; a test checks these models match them.
"""

from __future__ import annotations

import enum
import sys
from array import array
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# SQLite has no BIGINT autoincrement; INTEGER PRIMARY KEY is its 64-bit rowid.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class TokenArray(TypeDecorator[list[int]]):
    """A list of token ids stored as packed little-endian 32-bit integers (4 bytes a token)."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: list[int] | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack_ids(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> list[int] | None:
        return None if value is None else unpack_ids(bytes(value))


def pack_ids(ids: list[int]) -> bytes:
    packed = array("i", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


class ItemStatus(enum.StrEnum):
    # a later turn of a conversation, waiting for the turn before it to finish
    WAITING = "waiting"
    PENDING = "pending"
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"


UNFINISHED = (ItemStatus.WAITING, ItemStatus.PENDING, ItemStatus.QUEUED, ItemStatus.LEASED)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    tokenizer_path: Mapped[str] = mapped_column(Text)
    tokenizer_hash: Mapped[str] = mapped_column(String(64))
    # sha256 of each file of the tokenizer folder but weights (None: a run older than 0005b)
    tokenizer_files: Mapped[dict[str, str] | None] = mapped_column(JSON, nullable=True)
    # the folder's own Python code was allowed; every later load of it allows it again
    trust_remote_code: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    chat_template_hash: Mapped[str] = mapped_column(String(64))
    chat_template_kwargs: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    sampling_params: Mapped[dict[str, Any]] = mapped_column(JSON)
    samples_per_prompt: Mapped[int] = mapped_column(Integer, default=1)
    think_end_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    eos_token_ids: Mapped[list[int]] = mapped_column(JSON, default=list)
    fingerprint: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # `--render-with URL`: every prompt is built by that server's /v1/tokenize
    render_with: Mapped[str | None] = mapped_column(Text, nullable=True)
    # `--require-parity`: a server whose rendering differs from the stored prompts is paused
    require_parity: Mapped[bool] = mapped_column(default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # the message-normalization rules the run's prompts are built with (app.prompts.chat_path);
    # null for runs created before they were pinned
    normalization_version: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # `--weight-version V`: only servers reporting V serve the run (null: the first seen pins)
    weight_version: Mapped[str | None] = mapped_column(String(200), nullable=True)

    # set when the run's items moved to items_archive (`tokenmill archive`); no more enqueues
    archived_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # the archived run's counts and token sums, taken once its rows left the hot table (the
    # item counters follow the rows of items); null while the archive is not complete
    archived_counts: Mapped[dict[str, int] | None] = mapped_column(JSON, nullable=True)


class ToolSet(Base):
    """One distinct tools list of a run, stored once and referenced by its items."""

    __tablename__ = "tool_sets"
    __table_args__ = (UniqueConstraint("run_id", "tools_hash", name="uq_tool_sets_run_hash"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    # sha256 of the tools' JSON in their own key order (the order the template renders)
    tools_hash: Mapped[str] = mapped_column(String(64))
    tools: Mapped[list[dict[str, Any]]] = mapped_column(JSON)


def _partial(name: str, columns: tuple[str, ...], where: str) -> Index:
    return Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))


class Item(Base):
    __tablename__ = "items"
    __table_args__ = (
        UniqueConstraint(
            "run_id", "item_key", "sample_index", "turn_index", name="uq_items_run_key_sample_turn"
        ),
        # keyset pages of one status of a run (export, verify, report, reconcile) and the
        # "anything left to claim?" probe: one range of this index, in id order, no sort
        Index("ix_items_run_status_id", "run_id", "status", "id"),
        Index("ix_items_prev_item", "prev_item_id"),
        Index("ix_items_status_lease", "status", "lease_expires_at"),
        Index("ix_items_server_status", "server", "status"),
        Index("ix_items_server_finished", "server", "finished_at"),
        # Partial indexes hold only what the periodic queries look at (the active part of the
        # table), so their plans are the same whatever the planner's statistics say.
        _partial("ix_items_leased_started", ("started_at", "id"), "status = 'leased'"),
        _partial("ix_items_queued_at", ("queued_at", "id"), "status = 'queued'"),
        _partial("ix_items_done_finished", ("server", "finished_at"), "status = 'done'"),
        _partial("ix_items_uncompacted", ("run_id", "id"), "status = 'done' AND shard_uri IS NULL"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    item_key: Mapped[str] = mapped_column(String(200))
    sample_index: Mapped[int] = mapped_column(Integer, default=0)
    # multi-turn (`--turns all`): which assistant turn this item regenerates (0 = the first),
    # and the item of the turn before it, which must be done before this one gets a prompt
    turn_index: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    prev_item_id: Mapped[int | None] = mapped_column(
        BigId,
        ForeignKey("items.id", ondelete="CASCADE", name="fk_items_prev_item"),
        nullable=True,
    )
    line_no: Mapped[int | None] = mapped_column(Integer, nullable=True)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, nullable=True)
    # what else built the prompt: the row's tools (a run's distinct tools lists are stored
    # once) and its template kwargs merged over the run's (null: the run's own)
    tool_set_id: Mapped[int | None] = mapped_column(
        BigId,
        ForeignKey("tool_sets.id", ondelete="CASCADE", name="fk_items_tool_set"),
        nullable=True,
    )
    chat_template_kwargs: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # the row's fields that are not template inputs (source, category, ...), exported
    row_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    prompt_ids: Mapped[list[int]] = mapped_column(TokenArray)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=ItemStatus.PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    server: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # the worker running a second copy of this leased item on another server (hedging the
    # end of a run); cleared by the next claim. The first result written wins.
    hedge_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    output_ids: Mapped[list[int] | None] = mapped_column(TokenArray, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    matched_stop: Mapped[str | None] = mapped_column(String(64), nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    latency_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    queued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # compaction: the token arrays live in row `shard_row` of the Parquet shard `shard_uri`
    shard_uri: Mapped[str | None] = mapped_column(Text, nullable=True)
    shard_row: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # provenance of the result: meta_info.weight_version, and the sampling_params body sent
    weight_version: Mapped[str | None] = mapped_column(String(200), nullable=True)
    sampling_params: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # the input row's own sampling_params (merged over the run's for each sample)
    row_sampling_params: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


def _archive_columns() -> list[Column[Any]]:
    """The columns of items, for the archive: same names and types, no defaults; run_id keeps
    its foreign key, prev_item_id points at another archived row without one."""
    columns: list[Column[Any]] = []
    for col in Item.__table__.columns:
        fks = [ForeignKey("runs.id", ondelete="CASCADE")] if col.name == "run_id" else []
        columns.append(
            Column(
                col.name,
                col.type,
                *fks,
                primary_key=col.primary_key,
                autoincrement=False,
                nullable=col.nullable,
            )
        )
    return columns


# A finished, compacted run's rows, moved out of the hot table (`tokenmill archive`). Built
# from Item's columns, so a column added to items must be added here by the same migration.
ItemArchive = Table(
    "items_archive",
    Base.metadata,
    *_archive_columns(),
    Index("ix_items_archive_run_status_id", "run_id", "status", "id"),
    Index("ix_items_archive_prev_item", "prev_item_id"),
)


class Server(Base):
    __tablename__ = "servers"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    url: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), default="unknown")
    state_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    paused: Mapped[bool] = mapped_column(default=False)
    paused_by: Mapped[str | None] = mapped_column(String(16), nullable=True)
    pause_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0)
    consecutive_successes: Mapped[int] = mapped_column(Integer, default=0)
    last_probe_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    last_probe_ok: Mapped[bool | None] = mapped_column(nullable=True)
    last_probe_latency_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    fingerprint: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # the last parity check per run name: {"run": {"status", "checked", "mismatched", "at"}}
    parity: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    restart_command: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    workers: Mapped[list[str]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_at", "at"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    kind: Mapped[str] = mapped_column(String(40))
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), nullable=True
    )
    server: Mapped[str | None] = mapped_column(String(200), nullable=True)
    message: Mapped[str] = mapped_column(Text)
    details: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


# Item counters: kept by database triggers on `items` (migration 0005e) in the same transaction
# as every insert, update and delete of an item, so views read them instead of counting items.
# A row is one shard of one key: on Postgres the shard is the writing backend's pid (no two
# concurrent transactions ever update the same row), folded into shard 0 by the reconcile
# step; SQLite, with its single writer, uses shard 0 only. A key's value is the sum over its
# shards. "" stands for no server / no finish reason (NULL cannot be part of the key).


class ItemCount(Base):
    """Items of a run by server, status and finish reason, with their token sums."""

    __tablename__ = "item_counts"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    server: Mapped[str] = mapped_column(String(200), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), primary_key=True)
    finish_reason: Mapped[str] = mapped_column(String(16), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    item_count: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    # of those items, how many carry a hedge mark (a second copy ran on another server)
    hedged: Mapped[int] = mapped_column(BigInteger)


class ItemLatencyCount(Base):
    """Done items of a run by server and latency bucket (index into the fixed bounds, the
    last one past every bound), with their latency sum: histograms without reading items."""

    __tablename__ = "item_latency_counts"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    server: Mapped[str] = mapped_column(String(200), primary_key=True)
    bucket: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    item_count: Mapped[int] = mapped_column(BigInteger)
    latency_sum_s: Mapped[float] = mapped_column(Float)
