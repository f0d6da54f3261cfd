"""Items into the ledger and onto the queue: inserts (COPY on Postgres), the pending ids and
keys a producer publishes, pending → queued, and the queued items the reconciler publishes again."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Connection, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from app.core.models import ItemStatus
from app.ledger import common, database


@dataclass(frozen=True)
class NewItem:
    item_key: str
    sample_index: int
    line_no: int | None
    messages: list[dict[str, Any]] | None
    prompt_ids: list[int]
    # a later turn of a `--turns all` chain: inserted waiting, with no prompt yet
    turn_index: int = 0
    waiting: bool = False
    # the row's tools, its kwargs merged over the run's (None: the run's) and its metadata
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # the row's own sampling_params (None: the run's alone)
    sampling_params: dict[str, Any] | None = None
    # the prompt's images in prompt order (ImageRef.to_json); None: a text item
    images: list[dict[str, Any]] | None = None
    # continue_final_message applied: the text appended after the generation prompt
    assistant_prefix: str | None = None
    # the last turn of an agentic chain: its chain's ending is recorded once it is done
    ends_chain: bool = False


def tools_hash(tools: Sequence[dict[str, Any]]) -> str:
    """sha256 of the tools' JSON in their own key order (the order a template renders them
    in, so two lists that differ only in key order are two lists)."""
    text = json.dumps(list(tools), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _insert_ignoring_conflicts(conn: Connection) -> Any:
    if conn.dialect.name == "postgresql":
        return postgresql.insert(common.items).on_conflict_do_nothing(
            index_elements=["run_id", "item_key", "sample_index", "turn_index"]
        )
    if conn.dialect.name == "sqlite":
        return sqlite.insert(common.items).on_conflict_do_nothing(
            index_elements=["run_id", "item_key", "sample_index", "turn_index"]
        )
    raise NotImplementedError(f"unsupported database {conn.dialect.name}")


def insert_items(conn: Connection, run_id: int, new: Sequence[NewItem]) -> int:
    """Insert items that do not exist yet (unique run, key, sample); return how many were new."""
    if not new:
        return 0
    now = common.utcnow()
    tool_set_ids = _tool_set_ids(conn, run_id, [n.tools for n in new if n.tools])
    rows = [
        {
            "run_id": run_id,
            "item_key": n.item_key,
            "sample_index": n.sample_index,
            "line_no": n.line_no,
            "messages": n.messages,
            "tool_set_id": tool_set_ids[tools_hash(n.tools)] if n.tools else None,
            "chat_template_kwargs": n.chat_template_kwargs,
            "row_metadata": n.metadata,
            "row_sampling_params": n.sampling_params,
            "images": n.images,
            "assistant_prefix": n.assistant_prefix,
            "ends_chain": True if n.ends_chain else None,
            "prompt_ids": n.prompt_ids,
            "prompt_tokens": len(n.prompt_ids),
            "turn_index": n.turn_index,
            "status": (ItemStatus.WAITING if n.waiting else ItemStatus.PENDING).value,
            "attempts": 0,
            "created_at": now,
        }
        for n in new
    ]
    if conn.dialect.name == "postgresql":
        return _copy_insert_items(conn, rows)
    stmt = _insert_ignoring_conflicts(conn).returning(common.items.c.id)
    return len(conn.execute(stmt, rows).all())


def _tool_set_ids(
    conn: Connection, run_id: int, lists: Sequence[list[dict[str, Any]]]
) -> dict[str, int]:
    """The tool_sets id of each distinct tools list (by hash), stored once per run."""
    distinct = {tools_hash(tools): tools for tools in lists}
    if not distinct:
        return {}
    rows = [{"run_id": run_id, "tools_hash": h, "tools": t} for h, t in distinct.items()]
    if conn.dialect.name == "postgresql":
        stmt: Any = postgresql.insert(common.tool_sets).on_conflict_do_nothing(
            index_elements=["run_id", "tools_hash"]
        )
    else:
        stmt = sqlite.insert(common.tool_sets).on_conflict_do_nothing(
            index_elements=["run_id", "tools_hash"]
        )
    conn.execute(stmt, rows)
    found = select(common.tool_sets.c.tools_hash, common.tool_sets.c.id).where(
        common.tool_sets.c.run_id == run_id, common.tool_sets.c.tools_hash.in_(list(distinct))
    )
    return {str(h): int(i) for h, i in conn.execute(found)}


_ITEMS_LOAD = "tm_items_load"


def _copy_processor(conn: Connection, type_: Any) -> Any:
    """How a value of this column type is written by COPY: JSON as its text (psycopg's JSON
    adaptation is set up for statements, not COPY), the rest as the type's bind processor."""
    if isinstance(type_, JSON):
        serialize = getattr(conn.dialect, "_json_serializer", None) or json.dumps
        return serialize
    return type_.bind_processor(conn.dialect)


def _copy_insert_items(conn: Connection, rows: Sequence[dict[str, Any]]) -> int:
    """Postgres: COPY the rows into a temporary table of this transaction, then one INSERT ...
    SELECT ... ON CONFLICT DO NOTHING; its row count is exactly the number of new items.
    A multi-row INSERT of 512 prompts spent most of its time in psycopg building one huge
    statement (holding the GIL the templating needs); COPY streams the values instead."""
    columns = list(rows[0])
    # the SQLAlchemy column types turn values into what psycopg sends (token arrays → bytes,
    # JSON → its text), so the COPY carries exactly what the INSERT would have
    processors = [_copy_processor(conn, common.items.c[c].type) for c in columns]
    names = ", ".join(columns)
    # one load table per column set, so a second call in the transaction never COPYs into
    # another shape
    load = f"{_ITEMS_LOAD}_{zlib.crc32(names.encode()):08x}"
    dbapi = conn.connection.driver_connection
    assert dbapi is not None
    with dbapi.cursor() as cur:
        # same column types as items, no constraints; the table is dropped at commit (nothing
        # outlives the transaction: behind PgBouncer's transaction pooling the next one may
        # run on another server connection), and the explicit TRUNCATE below keeps a second
        # call in the same transaction from seeing these rows
        cur.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {load} ON COMMIT DROP AS "
            f"SELECT {names}, 0::bigint AS load_ord FROM items WITH NO DATA"
        )
        with cur.copy(f"COPY {load} ({names}, load_ord) FROM STDIN") as copy:
            for ord_, row in enumerate(rows):
                values = [
                    row[c] if p is None or row[c] is None else p(row[c])
                    for c, p in zip(columns, processors, strict=True)
                ]
                values.append(ord_)
                copy.write_row(values)
        # ids are handed out in line order, as the multi-row INSERT did
        cur.execute(
            f"INSERT INTO items ({names}) SELECT {names} FROM {load} ORDER BY load_ord "
            "ON CONFLICT (run_id, item_key, sample_index, turn_index) DO NOTHING"
        )
        inserted: int = cur.rowcount
        cur.execute(f"TRUNCATE {load}")
    return inserted


def refresh_statistics(conn: Connection) -> None:
    """ANALYZE the items table on Postgres: after a large insert the planner's stale row counts
    turn the claim UPDATE and the key lookup into scans (measured 5x slower per claim)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("ANALYZE items"))


def existing_keys(conn: Connection, run_id: int, keys: Iterable[str]) -> set[str]:
    keys = list(keys)
    if not keys:
        return set()
    stmt = select(common.items.c.item_key).where(
        common.items.c.run_id == run_id, common.items.c.item_key.in_(keys)
    )
    return set(conn.execute(stmt).scalars())


def pending_ids(
    conn: Connection, run_id: int, *, after_id: int = 0, limit: int = 5000
) -> list[int]:
    database.pin_index_plans(conn)
    stmt = (
        select(common.items.c.id)
        .where(
            common.run_status_range(conn, common.items, run_id, ItemStatus.PENDING.value, after_id)
        )
        .order_by(*common.run_status_order(common.items))
        .limit(limit)
    )
    return list(conn.execute(stmt).scalars())


def pending_keys(
    conn: Connection, run_id: int, *, after_id: int = 0, limit: int = 5000
) -> list[tuple[int, str]]:
    """(id, item key) of the run's pending items in id order (pending_ids with their keys)."""
    stmt = (
        select(common.items.c.id, common.items.c.item_key)
        .where(
            common.items.c.run_id == run_id,
            common.items.c.status == ItemStatus.PENDING.value,
            common.items.c.id > after_id,
        )
        .order_by(common.items.c.id)
        .limit(limit)
    )
    return [(int(r[0]), str(r[1])) for r in conn.execute(stmt)]


def mark_queued(conn: Connection, ids: Sequence[int]) -> int:
    """pending → queued after the ids were published (a worker may already have claimed some)."""
    if not ids:
        return 0
    stmt = (
        update(common.items)
        .where(
            common.items.c.id.in_(common._in_id_order(conn, ids)),
            common.items.c.status == ItemStatus.PENDING.value,
        )
        .values(status=ItemStatus.QUEUED.value, queued_at=common.utcnow())
    )
    return conn.execute(stmt).rowcount


def oldest_queued(
    conn: Connection,
    cutoff: datetime,
    *,
    limit: int,
    run_id: int | None = None,
    skip_runs: Sequence[int] = (),
) -> list[int]:
    """Ids of up to limit items queued before cutoff, the longest-queued first: an ordered
    read of the partial index of queued items, however many are queued (but skip_runs')."""
    database.pin_index_plans(conn)
    stmt = (
        select(common.items.c.id)
        .where(common.items.c.status == ItemStatus.QUEUED.value, common.items.c.queued_at < cutoff)
        .order_by(common.items.c.queued_at, common.items.c.id)
        .limit(limit)
    )
    if run_id is not None:
        stmt = stmt.where(common.items.c.run_id == run_id)
    if skip_runs:
        stmt = stmt.where(common.items.c.run_id.not_in(list(skip_runs)))
    return list(conn.execute(stmt).scalars())


# ids a statement of touch_queued updates: reconcile re-sends up to 10,000 lost items a pass
TOUCH_ROWS = 500


def touch_queued(conn: Connection, ids: Sequence[int]) -> None:
    """Restart the grace period of items just published again, TOUCH_ROWS a statement (so no
    statement grows with the lost items), each an index scan of those ids' primary keys in id
    order. (A `FOR UPDATE` subquery of the ids, as claims use for 32, was planned as a hash
    join over the whole primary key for 600 ids once the statistics were fresh.)"""
    ordered = sorted(ids)
    now = common.utcnow()
    for start in range(0, len(ordered), TOUCH_ROWS):
        chunk = ordered[start : start + TOUCH_ROWS]
        conn.execute(
            update(common.items)
            .where(
                common.items.c.id.in_(chunk),
                common.status_of_found() == ItemStatus.QUEUED.value,
            )
            .values(queued_at=now)
        )
