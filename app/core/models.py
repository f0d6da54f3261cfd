"""The ledger's tables as SQLAlchemy Core tables: runs, items, servers, events, counters.

The schema is changed only by Alembic migrations; a test checks these tables match them.
Core, not ORM: every query is a Core statement, and the ORM's import and mapper set-up cost
every command's start-up a fifth of a second (bench/cli_startup.py).
"""

from __future__ import annotations

import enum
import sys
from array import array
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
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.engine import Dialect
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


metadata = MetaData()


def _id() -> Column[Any]:
    return Column("id", BigId, primary_key=True, autoincrement=True)


def _unique_name() -> Column[Any]:
    return Column("name", String(200), nullable=False, unique=True)


def _when(name: str, *, nullable: bool = True) -> Column[Any]:
    return Column(name, DateTime(timezone=True), nullable=nullable)


runs = Table(
    "runs",
    metadata,
    _id(),
    _unique_name(),
    # what the run's items are for (app.core.run_kinds.RunKind); every run before 0021 generates
    Column("kind", String(20), nullable=False, server_default="generate"),
    Column("tokenizer_path", Text, nullable=False),
    Column("tokenizer_hash", String(64), nullable=False),
    # sha256 of each file of the tokenizer folder but weights (None: a run older than 0005b)
    Column("tokenizer_files", JSON, nullable=True),
    # the folder's own Python code was allowed; every later load of it allows it again
    Column("trust_remote_code", Boolean, nullable=False, default=False, server_default=false()),
    Column("chat_template_hash", String(64), nullable=False),
    Column("chat_template_kwargs", JSON, nullable=False, default=dict),
    Column("sampling_params", JSON, nullable=False),
    Column("samples_per_prompt", Integer, nullable=False, default=1),
    Column("think_end_id", Integer, nullable=True),
    Column("eos_token_ids", JSON, nullable=False, default=list),
    Column("fingerprint", JSON, nullable=True),
    # `--render-with URL`: every prompt is built by that server's /v1/tokenize
    Column("render_with", Text, nullable=True),
    # `--require-parity`: a server whose rendering differs from the stored prompts is paused
    Column("require_parity", Boolean, nullable=False, default=False, server_default=false()),
    _when("created_at", nullable=False),
    # the message-normalization rules the run's prompts are built with (app.prompts.chat_path);
    # null for runs created before they were pinned
    Column("normalization_version", String(40), nullable=True),
    # how the prompts are rendered besides the template text (app.prompts.chat_pins); null for
    # runs created before these were pinned
    Column("chat_pins", JSON, nullable=True),
    # `--weight-version V`: only servers reporting V serve the run (null: the first seen pins)
    Column("weight_version", String(200), nullable=True),
    # the run's multimodal pins (app.core.images.ImagePins.to_json); null: a text-only run
    Column("images", JSON, nullable=True),
    # the storage URL its images and compacted shards live in, pinned at creation: readers
    # resolve the run's keys against it (null: a run older than 0013, read with their own)
    Column("storage_url", Text, nullable=True),
    # `enqueue --servers NAME...`: the registered servers that alone serve the run (null: any)
    Column("servers", JSON, nullable=True),
    # "run": `tokenmill run` drives it, the fleet leaves it alone (null: a fleet run)
    Column("driver", String(20), nullable=True),
    # free slots go to the highest-priority run first, runs of one priority share them
    # (`enqueue --priority N`, `tokenmill priority RUN N`; migration run_priority); only a
    # server default, as kind's: an insert at a revision before it names no priority
    Column("priority", Integer, nullable=False, server_default=text("0")),
    # set when the run's items moved to items_archive (`tokenmill archive`); no more enqueues
    _when("archived_at"),
    # the archived run's counts and token sums, taken once its rows left the hot table (the
    # item counters follow the rows of items); null while the archive is not complete
    Column("archived_counts", JSON, nullable=True),
)

# One distinct tools list of a run, stored once and referenced by its items.
tool_sets = Table(
    "tool_sets",
    metadata,
    _id(),
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    # sha256 of the tools' JSON in their own key order (the order the template renders)
    Column("tools_hash", String(64), nullable=False),
    Column("tools", JSON, nullable=False),
    UniqueConstraint("run_id", "tools_hash", name="uq_tool_sets_run_hash"),
)


def _partial(name: str, columns: tuple[str, ...], where: str) -> Index:
    return Index(name, *columns, postgresql_where=text(where), sqlite_where=text(where))


def _reference(name: str, target: str, key: str) -> Column[Any]:
    """A nullable id pointing at another row (deleted with it)."""
    return Column(name, BigId, ForeignKey(target, ondelete="CASCADE", name=key), nullable=True)


def _item_columns() -> list[Column[Any]]:
    """The columns of items (the archive copies them: see _archive_columns)."""
    return [
        _id(),
        Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        Column("item_key", String(200), nullable=False),
        Column("sample_index", Integer, nullable=False, default=0),
        # multi-turn (`--turns all`): which assistant turn this item regenerates (0 = the
        # first), and the item of the turn before it, which must be done before this one gets
        # a prompt
        Column("turn_index", Integer, nullable=False, default=0, server_default="0"),
        _reference("prev_item_id", "items.id", "fk_items_prev_item"),
        Column("line_no", Integer, nullable=True),
        # SQL NULL for a pre-tokenized item (not JSON null), so that `messages IS NOT NULL`
        # finds the items rendered from messages (the parity sample reads them through the
        # indexes)
        Column("messages", JSON(none_as_null=True), nullable=True),
        # what else built the prompt: the row's tools (a run's distinct tools lists are stored
        # once) and its template kwargs merged over the run's (null: the run's own)
        _reference("tool_set_id", "tool_sets.id", "fk_items_tool_set"),
        Column("chat_template_kwargs", JSON, nullable=True),
        # the row's fields that are not template inputs (source, category, ...), exported
        Column("row_metadata", JSON, nullable=True),
        Column("prompt_ids", TokenArray, nullable=False),
        Column("prompt_tokens", Integer, nullable=False),
        Column("status", String(16), nullable=False, default=ItemStatus.PENDING),
        Column("attempts", Integer, nullable=False, default=0),
        Column("lease_owner", String(200), nullable=True),
        _when("lease_expires_at"),
        Column("server", String(200), nullable=True),
        # the worker running a second copy of this leased item on another server (hedging the
        # end of a run); cleared by the next claim. The first result written wins.
        Column("hedge_owner", String(200), nullable=True),
        Column("error", Text, nullable=True),
        # a failed item's reason (app.core.failures.failure_reason): its error without what
        # differs between items of one cause, so that failures group and match by cause
        Column("fail_reason", String(160), nullable=True),
        Column("output_ids", TokenArray, nullable=True),
        Column("finish_reason", String(16), nullable=True),
        Column("matched_stop", String(64), nullable=True),
        Column("completion_tokens", Integer, nullable=True),
        Column("cached_tokens", Integer, nullable=True),
        Column("latency_s", Float, nullable=True),
        _when("created_at", nullable=False),
        _when("queued_at"),
        _when("started_at"),
        _when("finished_at"),
        # compaction: the token arrays live in row `shard_row` of the Parquet shard `shard_uri`
        Column("shard_uri", Text, nullable=True),
        Column("shard_row", Integer, nullable=True),
        # provenance of the result: meta_info.weight_version, and the sampling_params body sent
        Column("weight_version", String(200), nullable=True),
        Column("sampling_params", JSON, nullable=True),
        # the input row's own sampling_params (merged over the run's for each sample)
        Column("row_sampling_params", JSON, nullable=True),
        # a row's continue_final_message applied to this item: the final assistant turn's text,
        # appended after the generation prompt as SGLang appends it ("" when that text is
        # empty: the turn dropped, nothing appended); null for every other item
        Column("assistant_prefix", Text, nullable=True),
        # the item's images in prompt order (app.core.images.ImageRef.to_json); SQL NULL (not
        # JSON null) for a text item, so that `images IS NOT NULL` finds the image items
        Column("images", JSON(none_as_null=True), nullable=True),
        # at done: how many times the server repeated each image's placeholder (the served
        # prompt ids are derived from them); null for a text item
        Column("image_token_counts", JSON, nullable=True),
        # an agentic chain's last kept turn: how the chain ended (CHAIN_END_*), null elsewhere
        Column("chain_end", String(32), nullable=True),
        # true on the last turn of an agentic chain (set at enqueue): once it is done, its
        # chain's ending is to be recorded (chain_end); null on every other item
        Column("ends_chain", Boolean, nullable=True),
        # the server that refused the item for a reason that can depend on the server (a 400
        # about length or limits, a tokenizer or vocabulary error): the item waits for another
        # server's verdict, and a claim by this one passes it over (migration 0025)
        Column("refused_by", String(200), nullable=True),
    ]


LEASE_SET = "lease_expires_at IS NOT NULL"
# the predicate of ix_items_unended, as each dialect renders `items.c.ends_chain` in a WHERE
UNENDED_PG = "ends_chain AND status = 'done' AND chain_end IS NULL"
UNENDED_SQLITE = "ends_chain = 1 AND status = 'done' AND chain_end IS NULL"

items = Table(
    "items",
    metadata,
    *_item_columns(),
    UniqueConstraint(
        "run_id", "item_key", "sample_index", "turn_index", name="uq_items_run_key_sample_turn"
    ),
    # keyset pages of one status of a run (export, verify, report, reconcile) and the
    # "anything left to claim?" probe: one range of this index, in id order, no sort
    Index("ix_items_run_status_id", "run_id", "status", "id"),
    # Partial on the column that is NULL until an item gets that far (migration
    # lean_item_rows): an item's insert and its updates before then add no entry (every update
    # of a row that is not HOT adds one to each index whose predicate it meets); every lookup
    # of these indexes is by equality or a range of that column, which implies the predicate.
    _partial("ix_items_prev_item", ("prev_item_id",), "prev_item_id IS NOT NULL"),
    _partial("ix_items_status_lease", ("status", "lease_expires_at"), LEASE_SET),
    _partial("ix_items_server_status", ("server", "status"), "server IS NOT NULL"),
    _partial("ix_items_server_finished", ("server", "finished_at"), "finished_at IS NOT NULL"),
    # Partial indexes hold only what the periodic queries look at (the active part of the
    # table), so their plans are the same whatever the planner's statistics say.
    _partial("ix_items_leased_started", ("started_at", "id"), "status = 'leased'"),
    _partial("ix_items_queued_at", ("queued_at", "id"), "status = 'queued'"),
    _partial("ix_items_done_finished", ("server", "finished_at"), "status = 'done'"),
    _partial("ix_items_uncompacted", ("run_id", "id"), "status = 'done' AND shard_uri IS NULL"),
    # the claimable queue of a run by kind: "a text (an image) item to claim?" is one probe;
    # pending and queued are the statuses from 'pending' to 'queued' (app.ledger.common)
    _partial(
        "ix_items_text_claimable",
        ("run_id", "status", "id"),
        "images IS NULL AND status >= 'pending' AND status <= 'queued'",
    ),
    # later turns still to run, by the turn they build on (what compaction must keep)
    _partial(
        "ix_items_prev_unfinished",
        ("prev_item_id",),
        "prev_item_id IS NOT NULL AND status <> 'done' AND status <> 'failed'",
    ),
    _partial(
        "ix_items_image_claimable",
        ("run_id", "status", "id"),
        "images IS NOT NULL AND status >= 'pending' AND status <= 'queued'",
    ),
    # failed items by reason: `status`, `verify` and `retry` read only the failed ones
    _partial("ix_items_failed_reason", ("run_id", "fail_reason"), "status = 'failed'"),
    # the agentic chains' endings by reason: `status` and the export manifest count them
    _partial("ix_items_chain_end", ("run_id", "chain_end"), "chain_end IS NOT NULL"),
    # done last turns of agentic chains whose ending is not recorded yet: what reconcile's
    # catch-up reads, O(the rows it fixes) whatever the run's size
    Index(
        "ix_items_unended",
        "run_id",
        "id",
        postgresql_where=text(UNENDED_PG),
        sqlite_where=text(UNENDED_SQLITE),
    ),
)


def _archive_columns() -> list[Column[Any]]:
    """The columns of items, for the archive: same names and types, no defaults; run_id keeps
    its foreign key, prev_item_id points at another archived row without one."""
    columns: list[Column[Any]] = []
    for col in items.columns:
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
# from items' columns, so a column added to items must be added here by the same migration.
items_archive = Table(
    "items_archive",
    metadata,
    *_archive_columns(),
    Index("ix_items_archive_run_status_id", "run_id", "status", "id"),
    Index("ix_items_archive_prev_item", "prev_item_id"),
    # an archived run's failed items by reason, as ix_items_failed_reason for the hot table
    _partial("ix_items_archive_failed_reason", ("run_id", "fail_reason"), "status = 'failed'"),
)

servers = Table(
    "servers",
    metadata,
    _id(),
    _unique_name(),
    # the control plane's URL of the server (the watchdog, restart and parity use it); its
    # workers never change it, they record the URL they send to as worker_url
    Column("url", Text, nullable=False),
    Column("worker_url", Text, nullable=True),
    # the GPU node whose workers serve it (TOKENMILL_NODE_NAME of its last worker)
    Column("node", String(200), nullable=True),
    Column("state", String(16), nullable=False, default="unknown"),
    _when("state_since"),
    Column("paused", Boolean, nullable=False, default=False),
    Column("paused_by", String(16), nullable=True),
    Column("pause_reason", Text, nullable=True),
    Column("consecutive_failures", Integer, nullable=False, default=0),
    Column("consecutive_successes", Integer, nullable=False, default=0),
    _when("last_probe_at"),
    Column("last_probe_ok", Boolean, nullable=True),
    Column("last_probe_latency_s", Float, nullable=True),
    Column("last_error", Text, nullable=True),
    Column("fingerprint", JSON, nullable=True),
    # the last parity check per run name: {"run": {"status", "checked", "mismatched", "at"}}
    Column("parity", JSON, nullable=True),
    Column("restart_command", JSON, nullable=True),
    Column("workers", JSON, nullable=False, default=list),
    _when("created_at", nullable=False),
    _when("updated_at", nullable=False),
)

events = Table(
    "events",
    metadata,
    _id(),
    _when("at", nullable=False),
    Column("kind", String(40), nullable=False),
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), nullable=True),
    Column("server", String(200), nullable=True),
    Column("message", Text, nullable=False),
    Column("details", JSON, nullable=True),
    Index("ix_events_at", "at"),
)


# Item counters: kept by database triggers on `items` (migration 0005e) in the same transaction
# as every insert, update and delete of an item, so views read them instead of counting items.
# A row is one shard of one key: on Postgres the shard is the writing backend's pid (no two
# concurrent transactions ever update the same row), folded into shard 0 by the reconcile
# step; SQLite, with its single writer, uses shard 0 only. A key's value is the sum over its
# shards. "" stands for no server / no finish reason (NULL cannot be part of the key).

# Items of a run by server, status and finish reason, with their token sums.
item_counts = Table(
    "item_counts",
    metadata,
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("server", String(200), primary_key=True),
    Column("status", String(16), primary_key=True),
    Column("finish_reason", String(16), primary_key=True),
    Column("shard", Integer, primary_key=True, autoincrement=False),
    Column("item_count", BigInteger, nullable=False),
    Column("prompt_tokens", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    # of those items, how many carry a hedge mark (a second copy ran on another server)
    Column("hedged", BigInteger, nullable=False),
)

# Done items of a run by server and latency bucket (index into the fixed bounds, the last one
# past every bound), with their latency sum: histograms without reading items.
item_latency_counts = Table(
    "item_latency_counts",
    metadata,
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("server", String(200), primary_key=True),
    Column("bucket", Integer, primary_key=True, autoincrement=False),
    Column("shard", Integer, primary_key=True, autoincrement=False),
    Column("item_count", BigInteger, nullable=False),
    Column("latency_sum_s", Float, nullable=False),
)

# An agentic run's chains by how they ended (chain_end), over items and items_archive: kept by
# triggers on both tables (migration 0020), sharded as item_counts. A row being archived is in
# both tables, so while a run is being archived its endings are counted from the rows instead.
chain_end_counts = Table(
    "chain_end_counts",
    metadata,
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("chain_end", String(32), primary_key=True),
    Column("shard", Integer, primary_key=True, autoincrement=False),
    Column("chain_count", BigInteger, nullable=False),
)

# A done item's speculative-decoding counters, as its server reported them in meta_info.
# Keyed by the item id without a foreign key to items, so the row stays when its item moves to
# items_archive; it goes with its run.
item_spec_stats = Table(
    "item_spec_stats",
    metadata,
    Column("item_id", BigId, primary_key=True, autoincrement=False),
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("verify_ct", Integer, nullable=False),
    Column("num_correct_drafts", Integer, nullable=False),
    Column("num_proposed_drafts", Integer, nullable=False),
    Column("accept_length", Float, nullable=False),
    Column("accept_rate", Float, nullable=False),
    # index: drafts accepted in one verify step; value: steps
    Column("histogram", JSON, nullable=False),
    Index("ix_item_spec_stats_run", "run_id", "item_id"),
)

# Per run and image: the token count the first server expanded it to. Every server of a run
# must expand one image alike; a server that differs is drift (its result is not written).
run_image_tokens = Table(
    "run_image_tokens",
    metadata,
    Column("run_id", ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("sha256", String(64), primary_key=True),
    Column("token_count", Integer, nullable=False),
    Column("server", String(200), nullable=False),
)

# Per server and worker (lease owner): the window it keeps in flight, as it last wrote it (every
# few seconds while it runs). Workers of one server split its capacity among the fresh rows;
# `tokenmill servers` and /metrics show them.
server_windows = Table(
    "server_windows",
    metadata,
    Column("server", String(200), primary_key=True),
    Column("owner", String(300), primary_key=True),
    Column("mode", String(8), nullable=False),  # "auto" or "fixed"
    Column("size", Integer, nullable=False),  # requests it keeps in flight
    Column("max_running", Integer, nullable=True),  # the server's, as it read them
    Column("max_total_tokens", BigInteger, nullable=True),
    Column("running", Integer, nullable=True),  # the server's last /v1/loads reading
    Column("queued", Integer, nullable=True),
    Column("reason", Text, nullable=True),  # of the last change of size
    _when("changed_at"),
    _when("updated_at", nullable=False),
    _when("loads_at"),  # when running/queued were read (a stale reading is aged, not shown as now)
)
