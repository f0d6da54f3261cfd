"""All ledger queries, by name: runs, item claims and leases, results, counts, events.

Every state change is a conditional update, so a redelivered message or a second worker
can never create a second result; the Postgres (or embedded SQLite) ledger is the truth.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    JSON,
    Connection,
    Select,
    Table,
    and_,
    bindparam,
    case,
    func,
    insert,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import NotFound, RunArchived, RunMismatch
from app.core.models import Event, Item, ItemArchive, ItemStatus, Run, Server, ToolSet, pack_ids
from app.ledger import counters
from app.ledger.database import pin_index_plans
from app.prompts.chat_path import NORMALIZATION_VERSION, tools_hash
from app.prompts.tokenization import file_changes

if TYPE_CHECKING:  # pyarrow loads when items are streamed (export, verify), not with every command
    from app.outputs.shards import ShardCache

log = logging.getLogger(__name__)

items = cast(Table, Item.__table__)
runs = cast(Table, Run.__table__)
servers = cast(Table, Server.__table__)
events = cast(Table, Event.__table__)
tool_sets = cast(Table, ToolSet.__table__)
# the rows of archived runs (app.ledger.archive): same columns as items
items_archive = ItemArchive

CLAIMABLE = (ItemStatus.PENDING.value, ItemStatus.QUEUED.value)
ERROR_MAX_CHARS = 2000


def run_status_range(conn: Connection, table: Table, run_id: int, status: str, after: int) -> Any:
    """WHERE for the items of one status of a run with ids above `after`, to be read ORDER BY
    run_id, status, id: one range of the (run_id, status, id) index whatever the statistics.

    On Postgres it is written as row comparisons, `(run_id, status, id) > (?, ?, after) AND
    (run_id, status) <= (?, ?)`. With plain equalities the planner treats run_id and status
    as constants, so the primary key also "delivers" the order; with stale statistics (after
    a big enqueue every item looks pending) it then chose to walk the primary key past every
    other row. Row comparisons leave the (run_id, status, id) index as the only way to that
    order without a sort, and the callers price sorts out (pin_index_plans)."""
    if conn.dialect.name != "postgresql":
        return and_(table.c.run_id == run_id, table.c.status == status, table.c.id > after)
    return and_(
        tuple_(table.c.run_id, table.c.status, table.c.id) > tuple_(run_id, status, after),
        tuple_(table.c.run_id, table.c.status) <= tuple_(run_id, status),
    )


def run_status_order(table: Table) -> tuple[Any, ...]:
    return (table.c.run_id, table.c.status, table.c.id)


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything tokenmill stores is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


# --- runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """What a run pins when it is created; a later enqueue must match it."""

    name: str
    tokenizer_path: str
    tokenizer_hash: str
    chat_template_hash: str
    chat_template_kwargs: dict[str, Any]
    sampling: SamplingParams
    samples_per_prompt: int
    think_end_id: int | None
    eos_token_ids: list[int]
    # `--turns all`: every assistant turn regenerated, chained (pinned)
    turns: str = "last"
    # the tokenizer's own code allowed: export, verify, reports and later turns load it so too
    trust_remote_code: bool = False
    # `--render-with URL`: prompts built by that server's /v1/tokenize (pinned)
    render_with: str | None = None
    require_parity: bool = False
    # sha256 of each tokenizer file (a later enqueue names the one that changed), and the
    # folder's hash by the rule of runs created before the manifest, to compare those with
    tokenizer_files: dict[str, str] | None = None
    legacy_tokenizer_hash: str | None = None
    # the message-normalization rules the prompts are built with (app.prompts.chat_path)
    normalization_version: str = NORMALIZATION_VERSION


@dataclass(frozen=True)
class RunInfo:
    id: int
    name: str
    tokenizer_path: str
    tokenizer_hash: str
    chat_template_hash: str
    chat_template_kwargs: dict[str, Any]
    sampling: SamplingParams
    samples_per_prompt: int
    think_end_id: int | None
    eos_token_ids: list[int]
    fingerprint: dict[str, Any] | None
    created_at: datetime
    turns: str = "last"
    trust_remote_code: bool = False
    render_with: str | None = None
    require_parity: bool = False
    tokenizer_files: dict[str, str] | None = None
    # None: created before the rules were pinned (app.prompts.chat_path.check_version refuses it)
    normalization_version: str | None = None


# The run's turn mode rides in its pinned sampling_params JSON (no column of its own), under
# a key SamplingParams does not have; present only for `--turns all`, so older runs read "last".
_TURNS_KEY = "turns"


def _run_info(row: Any) -> RunInfo:
    pinned = dict(row.sampling_params)
    turns = str(pinned.pop(_TURNS_KEY, "last"))
    return RunInfo(
        id=row.id,
        name=row.name,
        tokenizer_path=row.tokenizer_path,
        tokenizer_hash=row.tokenizer_hash,
        chat_template_hash=row.chat_template_hash,
        chat_template_kwargs=row.chat_template_kwargs or {},
        sampling=SamplingParams.from_json(pinned),
        samples_per_prompt=row.samples_per_prompt,
        think_end_id=row.think_end_id,
        eos_token_ids=list(row.eos_token_ids or []),
        fingerprint=row.fingerprint,
        created_at=as_utc(row.created_at) or utcnow(),
        turns=turns,
        render_with=row.render_with,
        require_parity=bool(row.require_parity),
        trust_remote_code=bool(row.trust_remote_code),
        tokenizer_files=dict(row.tokenizer_files) if row.tokenizer_files is not None else None,
        normalization_version=row.normalization_version,
    )


def run_differences(existing: RunInfo, spec: RunSpec) -> list[str]:
    """Lines naming every pinned setting in which spec differs from the existing run."""
    diffs: list[str] = []
    if spec.tokenizer_files is None:  # a spec built by hand: the hashes alone
        if existing.tokenizer_hash != spec.tokenizer_hash:
            diffs.append(
                f"tokenizer: {existing.tokenizer_path} (hash {existing.tokenizer_hash[:12]}) → "
                f"{spec.tokenizer_path} (hash {spec.tokenizer_hash[:12]})"
            )
    else:
        diffs += file_changes(
            existing.tokenizer_hash,
            existing.tokenizer_files,
            spec.tokenizer_hash,
            spec.tokenizer_files,
            spec.legacy_tokenizer_hash or spec.tokenizer_hash,
        )
    if existing.chat_template_hash != spec.chat_template_hash:
        diffs.append(
            f"chat template hash: {existing.chat_template_hash[:12]} → "
            f"{spec.chat_template_hash[:12]}"
        )
    if existing.chat_template_kwargs != spec.chat_template_kwargs:
        diffs.append(
            f"chat template kwargs: {existing.chat_template_kwargs} → {spec.chat_template_kwargs}"
        )
    old, new = existing.sampling.to_json(), spec.sampling.to_json()
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            diffs.append(f"{key}: {old.get(key)} → {new.get(key)}")
    if existing.samples_per_prompt != spec.samples_per_prompt:
        diffs.append(
            f"samples per prompt: {existing.samples_per_prompt} → {spec.samples_per_prompt}"
        )
    if existing.turns != spec.turns:
        diffs.append(f"turns: {existing.turns} → {spec.turns}")
    if existing.render_with != spec.render_with:
        diffs.append(f"render with: {existing.render_with} → {spec.render_with}")
    if existing.require_parity != spec.require_parity:
        diffs.append(f"require parity: {existing.require_parity} → {spec.require_parity}")
    return diffs


def get_run(conn: Connection, name: str) -> RunInfo:
    row = conn.execute(select(runs).where(runs.c.name == name)).first()
    if row is None:
        raise NotFound(f"no run named {name!r}")
    return _run_info(row)


def get_run_by_id(conn: Connection, run_id: int) -> RunInfo:
    row = conn.execute(select(runs).where(runs.c.id == run_id)).first()
    if row is None:
        raise NotFound(f"no run with id {run_id}")
    return _run_info(row)


def list_runs(conn: Connection) -> list[RunInfo]:
    return [_run_info(r) for r in conn.execute(select(runs).order_by(runs.c.id))]


def get_or_create_run(conn: Connection, spec: RunSpec) -> tuple[RunInfo, bool]:
    """The run named spec.name, created if new; RunMismatch if it pins other settings."""
    try:
        existing = get_run(conn, spec.name)
    except NotFound:
        existing = None
    if existing is not None:
        if run_archived(conn, existing.id):
            raise RunArchived(
                f"run {spec.name!r} is archived (its items left the ledger after it finished "
                "and was compacted); enqueue into a new --run name"
            )
        diffs = run_differences(existing, spec)
        if diffs:
            raise RunMismatch(
                f"run {spec.name!r} already exists with other settings; "
                "use a new --run name or the original settings. Differences: " + "; ".join(diffs)
            )
        return existing, False
    conn.execute(
        insert(runs).values(
            name=spec.name,
            tokenizer_path=spec.tokenizer_path,
            tokenizer_hash=spec.tokenizer_hash,
            chat_template_hash=spec.chat_template_hash,
            chat_template_kwargs=spec.chat_template_kwargs,
            sampling_params=_pinned_sampling(spec),
            samples_per_prompt=spec.samples_per_prompt,
            think_end_id=spec.think_end_id,
            eos_token_ids=spec.eos_token_ids,
            render_with=spec.render_with,
            require_parity=spec.require_parity,
            trust_remote_code=spec.trust_remote_code,
            tokenizer_files=spec.tokenizer_files,
            created_at=utcnow(),
            normalization_version=spec.normalization_version,
        )
    )
    return get_run(conn, spec.name), True


def _pinned_sampling(spec: RunSpec) -> dict[str, Any]:
    pinned = spec.sampling.to_json()
    if spec.turns != "last":
        pinned[_TURNS_KEY] = spec.turns
    return pinned


def run_archived(conn: Connection, run_id: int) -> bool:
    """Whether the run's items were moved to items_archive (app.ledger.archive)."""
    stmt = select(runs.c.archived_at).where(runs.c.id == run_id)
    return conn.execute(stmt).scalar() is not None


def pin_fingerprint(conn: Connection, run_id: int, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Record the server fingerprint the first time a run sees one; return the pinned one."""
    conn.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.fingerprint.is_(None))
        .values(fingerprint=fingerprint)
    )
    pinned = conn.execute(select(runs.c.fingerprint).where(runs.c.id == run_id)).scalar_one()
    return dict(pinned or {})


# --- items: insert and queue -------------------------------------------------------------


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


def _insert_ignoring_conflicts(conn: Connection) -> Any:
    if conn.dialect.name == "postgresql":
        return postgresql.insert(items).on_conflict_do_nothing(
            index_elements=["run_id", "item_key", "sample_index", "turn_index"]
        )
    if conn.dialect.name == "sqlite":
        return sqlite.insert(items).on_conflict_do_nothing(
            index_elements=["run_id", "item_key", "sample_index", "turn_index"]
        )
    raise NotImplementedError(f"unsupported database {conn.dialect.name}")


def insert_items(conn: Connection, run_id: int, new: Sequence[NewItem]) -> int:
    """Insert items that do not exist yet (unique run, key, sample); return how many were new."""
    if not new:
        return 0
    now = utcnow()
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
    stmt = _insert_ignoring_conflicts(conn).returning(items.c.id)
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
        stmt: Any = postgresql.insert(tool_sets).on_conflict_do_nothing(
            index_elements=["run_id", "tools_hash"]
        )
    else:
        stmt = sqlite.insert(tool_sets).on_conflict_do_nothing(
            index_elements=["run_id", "tools_hash"]
        )
    conn.execute(stmt, rows)
    found = select(tool_sets.c.tools_hash, tool_sets.c.id).where(
        tool_sets.c.run_id == run_id, tool_sets.c.tools_hash.in_(list(distinct))
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
    """Postgres: COPY the rows into a session-private temporary table, then one INSERT ...
    SELECT ... ON CONFLICT DO NOTHING; its row count is exactly the number of new items.
    A multi-row INSERT of 512 prompts spent most of its time in psycopg building one huge
    statement (holding the GIL the templating needs); COPY streams the values instead."""
    columns = list(rows[0])
    # the SQLAlchemy column types turn values into what psycopg sends (token arrays → bytes,
    # JSON → its text), so the COPY carries exactly what the INSERT would have
    processors = [_copy_processor(conn, items.c[c].type) for c in columns]
    names = ", ".join(columns)
    # one load table per column set, so a pooled session never COPYs into a stale shape
    load = f"{_ITEMS_LOAD}_{zlib.crc32(names.encode()):08x}"
    dbapi = conn.connection.driver_connection
    assert dbapi is not None
    with dbapi.cursor() as cur:
        # same column types as items, no constraints; rows vanish at commit, and the explicit
        # TRUNCATE below keeps a second call in the same transaction from seeing these ones
        cur.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {load} ON COMMIT DELETE ROWS AS "
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
    stmt = select(items.c.item_key).where(items.c.run_id == run_id, items.c.item_key.in_(keys))
    return set(conn.execute(stmt).scalars())


def pending_ids(
    conn: Connection, run_id: int, *, after_id: int = 0, limit: int = 5000
) -> list[int]:
    pin_index_plans(conn)
    stmt = (
        select(items.c.id)
        .where(run_status_range(conn, items, run_id, ItemStatus.PENDING.value, after_id))
        .order_by(*run_status_order(items))
        .limit(limit)
    )
    return list(conn.execute(stmt).scalars())


def pending_keys(
    conn: Connection, run_id: int, *, after_id: int = 0, limit: int = 5000
) -> list[tuple[int, str]]:
    """(id, item key) of the run's pending items in id order (pending_ids with their keys)."""
    stmt = (
        select(items.c.id, items.c.item_key)
        .where(
            items.c.run_id == run_id,
            items.c.status == ItemStatus.PENDING.value,
            items.c.id > after_id,
        )
        .order_by(items.c.id)
        .limit(limit)
    )
    return [(int(r[0]), str(r[1])) for r in conn.execute(stmt)]


def _in_id_order(conn: Connection, ids: Sequence[int]) -> Any:
    """What an UPDATE of these ids matches, so that Postgres locks the rows in id order (a
    `SELECT … ORDER BY id FOR UPDATE` subquery). Two UPDATEs of overlapping id sets (a
    producer marking ids queued while a worker claims them) otherwise lock rows in scan
    order, which stops being id order once rows have been updated: a deadlock, and one of the
    two fails (measured: a worker lost a message that way in bench/balance.py)."""
    if conn.dialect.name != "postgresql":
        return list(ids)
    return (
        select(items.c.id).where(items.c.id.in_(list(ids))).order_by(items.c.id).with_for_update()
    )


def mark_queued(conn: Connection, ids: Sequence[int]) -> int:
    """pending → queued after the ids were published (a worker may already have claimed some)."""
    if not ids:
        return 0
    stmt = (
        update(items)
        .where(items.c.id.in_(_in_id_order(conn, ids)), items.c.status == ItemStatus.PENDING.value)
        .values(status=ItemStatus.QUEUED.value, queued_at=utcnow())
    )
    return conn.execute(stmt).rowcount


# --- items: claims, leases and outcomes -------------------------------------------------


@dataclass(frozen=True)
class ClaimedItem:
    """An item leased to one worker: everything needed to send it, nothing more."""

    id: int
    run_id: int
    sample_index: int
    prompt_ids: list[int]
    attempts: int
    item_key: str = ""
    turn_index: int = 0


_CLAIM_COLUMNS = (
    items.c.id,
    items.c.run_id,
    items.c.sample_index,
    items.c.prompt_ids,
    items.c.attempts,
    items.c.item_key,
    items.c.turn_index,
)


def _claimable(now: datetime) -> Any:
    return or_(
        items.c.status.in_(CLAIMABLE),
        and_(items.c.status == ItemStatus.LEASED.value, items.c.lease_expires_at < now),
    )


def claim_items(
    conn: Connection, ids: Sequence[int], *, owner: str, server: str, lease_s: float
) -> list[ClaimedItem]:
    """Lease the given items to owner if nobody holds them; already-leased or finished items
    are skipped, so a redelivered message claims nothing."""
    if not ids:
        return []
    now = utcnow()
    stmt = (
        update(items)
        .where(items.c.id.in_(_in_id_order(conn, ids)), _claimable(now))
        .values(
            status=ItemStatus.LEASED.value,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_s),
            server=server,
            started_at=now,
            hedge_owner=None,
        )
        .returning(*_CLAIM_COLUMNS)
    )
    claimed = [ClaimedItem(**row._mapping) for row in conn.execute(stmt)]
    claimed.sort(key=lambda c: c.id)
    return claimed


def claim_next(
    conn: Connection,
    *,
    owner: str,
    server: str,
    lease_s: float,
    limit: int,
    run_id: int | None = None,
) -> list[ClaimedItem]:
    """Lease up to limit claimable items straight from the ledger (the embedded runner's feed)."""
    if limit <= 0:
        return []
    now = utcnow()
    pick = select(items.c.id).where(_claimable(now)).order_by(items.c.id).limit(limit)
    if run_id is not None:
        pick = pick.where(items.c.run_id == run_id)
    if conn.dialect.name == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    ids = list(conn.execute(pick).scalars())
    return claim_items(conn, ids, owner=owner, server=server, lease_s=lease_s)


def item_keys(conn: Connection, ids: Sequence[int]) -> dict[int, tuple[int, str]]:
    """id → (run id, item key) of these items (what a message's ids group by)."""
    if not ids:
        return {}
    stmt = select(items.c.id, items.c.run_id, items.c.item_key).where(items.c.id.in_(list(ids)))
    return {int(r[0]): (int(r[1]), str(r[2])) for r in conn.execute(stmt)}


def claim_next_groups(
    conn: Connection,
    *,
    owner: str,
    server: str,
    lease_s: float,
    limit: int,
    run_id: int,
) -> list[ClaimedItem]:
    """Lease the claimable items of up to limit keys of a run, every claimable item of a key
    together (a `--turns each` conversation runs on one server); keys in id order."""
    if limit <= 0:
        return []
    now = utcnow()
    first = (
        select(items.c.item_key, func.min(items.c.id).label("first_id"))
        .where(_claimable(now), items.c.run_id == run_id)
        .group_by(items.c.item_key)
        .order_by("first_id")
        .limit(limit)
    )
    keys = [str(r[0]) for r in conn.execute(first)]
    if not keys:
        return []
    pick = select(items.c.id).where(
        items.c.run_id == run_id, items.c.item_key.in_(keys), _claimable(now)
    )
    ids = list(conn.execute(pick).scalars())
    return claim_items(conn, ids, owner=owner, server=server, lease_s=lease_s)


def hedge_candidates(
    conn: Connection, *, server: str, limit: int, skip_runs: Sequence[int] = ()
) -> list[tuple[int, int]]:
    """(item id, run id) of up to `limit` items worth a second copy on `server` ("hedging"):
    leased to another server, not hedged yet, in runs with nothing left to claim (the end of
    a run, when `server` would otherwise idle) and not in skip_runs (runs `server` may not
    serve); the longest-running first."""
    if limit <= 0:
        return []
    pin_index_plans(conn)
    # Three small steps instead of one anti-join, whose plan (a nested loop over a scan of
    # the whole table) the planner picked at the end of a run: the runs of the live leases
    # (read through an index of leases), one indexed probe per run, then the oldest leases.
    live = and_(
        items.c.status == ItemStatus.LEASED.value,
        items.c.lease_expires_at > utcnow(),
        items.c.server != server,
        items.c.hedge_owner.is_(None),
    )
    leased_runs = conn.execute(select(items.c.run_id).where(live).distinct()).scalars()
    ending = [r for r in leased_runs if r not in skip_runs and not claimable_left(conn, r)]
    if not ending:
        return []
    pick = (
        select(items.c.id, items.c.run_id)
        .where(live, items.c.run_id.in_(ending))
        .order_by(items.c.started_at, items.c.id)
        .limit(limit)
    )
    return [(int(r[0]), int(r[1])) for r in conn.execute(pick)]


def claimable_left(conn: Connection, run_id: int) -> bool:
    """Whether the run still has items to claim (pending or queued)."""
    return run_has_items(conn, run_id, CLAIMABLE)


def run_has_items(conn: Connection, run_id: int, statuses: Iterable[str]) -> bool:
    """Whether the run has an item in one of these statuses: one probe of the
    (run_id, status, id) index per status, which stops at the first row found. Written as a
    range of that index in its order (run_status_range), it stays there whatever the
    statistics say: with stale ones (everything pending after a big enqueue) a bare LIMIT 1
    was planned as a scan expected to stop at once, and read the whole table when the run had
    no such item."""
    pin_index_plans(conn)
    for status in statuses:
        probe = select(items.c.id).where(run_status_range(conn, items, run_id, status, 0))
        if conn.execute(probe.order_by(*run_status_order(items)).limit(1)).first() is not None:
            return True
    return False


def mark_hedged(conn: Connection, ids: Sequence[int], *, owner: str) -> list[ClaimedItem]:
    """Mark items as hedged by owner and return what a copy needs; the lease stays with its
    holder and the first result written wins. Conditional, so of two hedgers racing for an
    item one gets it; an item finished or released meanwhile is skipped."""
    if not ids:
        return []
    stmt = (
        update(items)
        .where(
            items.c.id.in_(_in_id_order(conn, ids)),
            items.c.status == ItemStatus.LEASED.value,
            items.c.hedge_owner.is_(None),
        )
        .values(hedge_owner=owner)
        .returning(*_CLAIM_COLUMNS)
    )
    order = {item_id: i for i, item_id in enumerate(ids)}
    hedged = [ClaimedItem(**row._mapping) for row in conn.execute(stmt)]
    hedged.sort(key=lambda c: order[c.id])
    return hedged


def unmark_hedged(conn: Connection, ids: Sequence[int], *, owner: str) -> int:
    """Take back owner's hedge marks (copies that were never sent), so others may hedge."""
    if not ids:
        return 0
    stmt = (
        update(items)
        .where(items.c.id.in_(list(ids)), items.c.hedge_owner == owner)
        .values(hedge_owner=None)
    )
    return conn.execute(stmt).rowcount


def finished_among(conn: Connection, ids: Sequence[int]) -> set[int]:
    """Which of these items are done or failed (so a copy still running is wasted)."""
    if not ids:
        return set()
    pin_index_plans(conn)
    # by primary key only, the status tested here: no plan can prefer a status index
    final = (ItemStatus.DONE.value, ItemStatus.FAILED.value)
    stmt = select(items.c.id, items.c.status).where(items.c.id.in_(list(ids)))
    return {int(item_id) for item_id, status in conn.execute(stmt) if status in final}


def extend_leases(conn: Connection, *, owner: str, lease_s: float) -> int:
    """Heartbeat: push out the expiry of every lease this owner holds.

    On Postgres the rows are locked by a `FOR UPDATE SKIP LOCKED` query first: a row that a
    result write holds is being finished (or its retry extends the lease itself), and
    waiting for it while holding other rows is how a heartbeat deadlocked against its own
    worker's writer."""
    mine = and_(items.c.lease_owner == owner, items.c.status == ItemStatus.LEASED.value)
    stmt = update(items).values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
    if conn.dialect.name != "postgresql":
        return conn.execute(stmt.where(mine)).rowcount
    # a CTE is locked once (as an IN subquery it was run again for every lease: O(leases²)),
    # and its rows, locked and checked, are then found by primary key only
    locked = select(items.c.id).where(mine).with_for_update(skip_locked=True).cte("locked")
    return conn.execute(stmt.where(items.c.id == locked.c.id)).rowcount


@dataclass(frozen=True)
class Done:
    item_id: int
    result: GenerateResult
    attempts_used: int = 1
    # the server that produced the result, when it is not the one that claimed the item (a
    # hedge); None keeps the claimer's
    server: str | None = None


@dataclass(frozen=True)
class Failed:
    item_id: int
    error: str
    attempts_used: int = 1


@dataclass(frozen=True)
class RetryLater:
    """A retryable failure: the attempt counts, the lease stays with the worker."""

    item_id: int
    error: str


@dataclass(frozen=True)
class Released:
    """Give the item back untouched (server down, paused, shutting down): no attempt spent."""

    item_id: int
    reason: str


Outcome = Done | Failed | RetryLater | Released


def _not_final() -> Any:
    # plain comparisons: an IN list cannot be used inside an executemany
    return and_(items.c.status != ItemStatus.DONE.value, items.c.status != ItemStatus.FAILED.value)


def _trim(text: str) -> str:
    return text if len(text) <= ERROR_MAX_CHARS else text[: ERROR_MAX_CHARS - 1] + "…"


# Postgres: a batch of results as one UPDATE rather than one per item, so that the item
# counters' statement-level trigger (migration 0005e) runs once per batch, not once per item.
# The rows are locked in id order, as `_in_id_order` does; the first result of an item wins.
_DONE_TOGETHER = text(
    """
UPDATE items SET
    status = 'done', output_ids = v.output_ids, finish_reason = v.finish_reason,
    matched_stop = v.matched, prompt_tokens = v.prompt, completion_tokens = v.completion,
    cached_tokens = v.cached, latency_s = v.latency, server = coalesce(v.server, items.server),
    attempts = items.attempts + v.attempts, error = NULL, lease_owner = NULL,
    lease_expires_at = NULL, finished_at = :now
FROM unnest(
    CAST(:ids AS bigint[]), CAST(:outputs AS bytea[]), CAST(:reasons AS text[]),
    CAST(:matched AS text[]), CAST(:prompt AS integer[]), CAST(:completion AS integer[]),
    CAST(:cached AS integer[]), CAST(:latency AS double precision[]),
    CAST(:attempts AS integer[]), CAST(:servers AS text[])
) AS v(id, output_ids, finish_reason, matched, prompt, completion, cached, latency, attempts,
       server)
WHERE items.id = v.id AND items.status <> 'done' AND items.status <> 'failed'
  AND items.id IN (
    SELECT id FROM items WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id FOR UPDATE
  )
"""
)


def _record_done_together(conn: Connection, rows: list[dict[str, Any]], now: datetime) -> None:
    first: dict[int, dict[str, Any]] = {}
    for row in rows:
        first.setdefault(row["b_id"], row)
    picked = list(first.values())
    conn.execute(
        _DONE_TOGETHER,
        {
            "now": now,
            "ids": [r["b_id"] for r in picked],
            "outputs": [pack_ids(r["b_output_ids"]) for r in picked],
            "reasons": [r["b_finish_reason"] for r in picked],
            "matched": [r["b_matched"] for r in picked],
            "prompt": [r["b_prompt"] for r in picked],
            "completion": [r["b_completion"] for r in picked],
            "cached": [r["b_cached"] for r in picked],
            "latency": [r["b_latency"] for r in picked],
            "attempts": [r["b_attempts"] for r in picked],
            "servers": [r["b_server"] for r in picked],
        },
    )


def record_outcomes(
    conn: Connection, outcomes: Sequence[Outcome], *, owner: str, lease_s: float
) -> list[int]:
    """Write outcomes idempotently in one transaction; return the ids released to the queue.

    The first result written for an item wins; a finished item is never written again.
    """
    now = utcnow()
    _lock_in_id_order(conn, [o.item_id for o in outcomes])
    by_id = sorted(outcomes, key=lambda o: o.item_id)
    done = [o for o in by_id if isinstance(o, Done)]
    failed = [o for o in by_id if isinstance(o, Failed)]
    retries = [o for o in by_id if isinstance(o, RetryLater)]
    released = [o for o in by_id if isinstance(o, Released)]
    if done:
        stmt = (
            update(items)
            .where(items.c.id == bindparam("b_id"), _not_final())
            .values(
                status=ItemStatus.DONE.value,
                output_ids=bindparam("b_output_ids"),
                finish_reason=bindparam("b_finish_reason"),
                matched_stop=bindparam("b_matched"),
                # the server's count, which `tokenmill verify` checks against prompt_ids
                prompt_tokens=bindparam("b_prompt"),
                completion_tokens=bindparam("b_completion"),
                cached_tokens=bindparam("b_cached"),
                latency_s=bindparam("b_latency"),
                server=func.coalesce(
                    bindparam("b_server", type_=items.c.server.type), items.c.server
                ),
                attempts=items.c.attempts + bindparam("b_attempts"),
                error=None,
                lease_owner=None,
                lease_expires_at=None,
                finished_at=now,
            )
        )
        rows = [
            {
                "b_id": o.item_id,
                "b_output_ids": o.result.output_ids,
                "b_finish_reason": o.result.finish_reason,
                "b_prompt": o.result.prompt_tokens,
                "b_matched": None
                if o.result.matched_stop is None
                else str(o.result.matched_stop)[:64],
                "b_completion": o.result.completion_tokens,
                "b_cached": o.result.cached_tokens,
                "b_latency": o.result.e2e_latency_s,
                "b_attempts": o.attempts_used,
                "b_server": o.server,
            }
            for o in done
        ]
        if conn.dialect.name == "postgresql" and len(rows) > 1:
            _record_done_together(conn, rows, now)
        else:
            conn.execute(stmt, rows)
    if failed:
        stmt = (
            update(items)
            .where(items.c.id == bindparam("b_id"), _not_final())
            .values(
                status=ItemStatus.FAILED.value,
                error=bindparam("b_error"),
                attempts=items.c.attempts + bindparam("b_attempts"),
                lease_owner=None,
                lease_expires_at=None,
                finished_at=now,
            )
        )
        conn.execute(
            stmt,
            [
                {"b_id": o.item_id, "b_error": _trim(o.error), "b_attempts": o.attempts_used}
                for o in failed
            ],
        )
    if retries:
        stmt = (
            update(items)
            .where(
                items.c.id == bindparam("b_id"),
                items.c.status == ItemStatus.LEASED.value,
                items.c.lease_owner == owner,
            )
            .values(
                error=bindparam("b_error"),
                attempts=items.c.attempts + 1,
                lease_expires_at=now + timedelta(seconds=lease_s),
            )
        )
        conn.execute(stmt, [{"b_id": o.item_id, "b_error": _trim(o.error)} for o in retries])
    released_ids: list[int] = []
    if released:
        ids = [o.item_id for o in released]
        stmt = (
            update(items)
            .where(
                items.c.id.in_(ids),
                items.c.status == ItemStatus.LEASED.value,
                items.c.lease_owner == owner,
            )
            .values(
                status=ItemStatus.QUEUED.value,
                lease_owner=None,
                lease_expires_at=None,
                queued_at=now,
            )
            .returning(items.c.id)
        )
        released_ids = sorted(conn.execute(stmt).scalars())
    return released_ids


def _lock_in_id_order(conn: Connection, ids: Sequence[int]) -> None:
    """Postgres: lock these rows in id order before a write that touches them in groups, so
    it takes its locks in the same order as claims (and never waits on a heartbeat, which
    skips locked rows)."""
    if ids and conn.dialect.name == "postgresql":
        stmt = select(items.c.id).where(items.c.id.in_(sorted(set(ids)))).order_by(items.c.id)
        conn.execute(stmt.with_for_update()).all()


def release_owner(conn: Connection, owner: str) -> list[int]:
    """Give back every lease an owner holds (a worker shutting down); return the ids."""
    stmt = (
        update(items)
        .where(items.c.lease_owner == owner, items.c.status == ItemStatus.LEASED.value)
        .values(
            status=ItemStatus.QUEUED.value,
            lease_owner=None,
            lease_expires_at=None,
            queued_at=utcnow(),
        )
        .returning(items.c.id)
    )
    return sorted(conn.execute(stmt).scalars())


def requeue_expired(
    conn: Connection, *, run_id: int | None = None, limit: int = 10000
) -> list[int]:
    """Items whose lease expired (their worker died) go back to queued; return their ids."""
    pin_index_plans(conn)
    now = utcnow()
    pick = (
        select(items.c.id)
        .where(items.c.status == ItemStatus.LEASED.value, items.c.lease_expires_at < now)
        .limit(limit)
    )
    if run_id is not None:
        pick = pick.where(items.c.run_id == run_id)
    ids = list(conn.execute(pick).scalars())
    if not ids:
        return []
    stmt = (
        update(items)
        .where(
            items.c.id.in_(ids),
            items.c.status == ItemStatus.LEASED.value,
            items.c.lease_expires_at < now,
        )
        .values(
            status=ItemStatus.QUEUED.value, lease_owner=None, lease_expires_at=None, queued_at=now
        )
        .returning(items.c.id)
    )
    return sorted(conn.execute(stmt).scalars())


def oldest_queued(
    conn: Connection, cutoff: datetime, *, limit: int, run_id: int | None = None
) -> list[int]:
    """Ids of up to limit items queued before cutoff, the longest-queued first: an ordered
    read of the partial index of queued items, however many are queued."""
    pin_index_plans(conn)
    stmt = (
        select(items.c.id)
        .where(items.c.status == ItemStatus.QUEUED.value, items.c.queued_at < cutoff)
        .order_by(items.c.queued_at, items.c.id)
        .limit(limit)
    )
    if run_id is not None:
        stmt = stmt.where(items.c.run_id == run_id)
    return list(conn.execute(stmt).scalars())


def touch_queued(conn: Connection, ids: Sequence[int]) -> None:
    """Restart the grace period of items just published again."""
    conn.execute(
        update(items)
        .where(items.c.id.in_(list(ids)), items.c.status == ItemStatus.QUEUED.value)
        .values(queued_at=utcnow())
    )


# --- multi-turn chains (`--turns all`) -------------------------------------------------------


def link_turns(conn: Connection, run_id: int, keys: Sequence[str]) -> int:
    """Point every later turn of these keys at the item of the turn before it (same key and
    sample); idempotent, only unlinked items are touched."""
    if not keys:
        return 0
    prev = items.alias("prev")
    prev_id = (
        select(prev.c.id)
        .where(
            prev.c.run_id == items.c.run_id,
            prev.c.item_key == items.c.item_key,
            prev.c.sample_index == items.c.sample_index,
            prev.c.turn_index == items.c.turn_index - 1,
        )
        .scalar_subquery()
    )
    stmt = (
        update(items)
        .where(
            items.c.run_id == run_id,
            items.c.item_key.in_(list(keys)),
            items.c.turn_index > 0,
            items.c.prev_item_id.is_(None),
        )
        .values(prev_item_id=prev_id)
    )
    return conn.execute(stmt).rowcount


@dataclass(frozen=True)
class WaitingTurn:
    """A waiting turn whose previous turn has finished (done or failed): ready to advance.

    context holds the original user/tool turns that lead to this turn's answer."""

    id: int
    run_id: int
    item_key: str
    sample_index: int
    turn_index: int
    context: list[dict[str, Any]]
    prev: StoredItem


def ready_turns(
    conn: Connection,
    *,
    prev_ids: Sequence[int] | None = None,
    run_id: int | None = None,
    after_id: int = 0,
    limit: int = 500,
) -> list[WaitingTurn]:
    """Waiting items whose previous turn is done or failed: the successors of prev_ids (the
    worker's just-committed results), or of a whole run or every run (the catch-up)."""
    if prev_ids is not None and not prev_ids:
        return []
    prev = items.alias("prev")
    stmt = (
        select(
            items.c.id,
            items.c.run_id,
            items.c.item_key,
            items.c.sample_index,
            items.c.turn_index,
            items.c.messages,
            items.c.prev_item_id,
        )
        .join(prev, prev.c.id == items.c.prev_item_id)
        .where(
            items.c.status == ItemStatus.WAITING.value,
            prev.c.status.in_([ItemStatus.DONE.value, ItemStatus.FAILED.value]),
            items.c.id > after_id,
        )
        .order_by(items.c.id)
        .limit(limit)
    )
    if prev_ids is not None:
        stmt = stmt.where(items.c.prev_item_id.in_(list(prev_ids)))
    if run_id is not None:
        stmt = stmt.where(items.c.run_id == run_id)
    rows = list(conn.execute(stmt))
    # a later turn is only ever waiting on an uncompacted item (compaction skips those), so
    # the previous turn's arrays are in the ledger
    previous = {s.id: s for s in stored_items(conn, [r.prev_item_id for r in rows])}
    return [
        WaitingTurn(
            id=r.id,
            run_id=r.run_id,
            item_key=r.item_key,
            sample_index=r.sample_index,
            turn_index=r.turn_index,
            context=list(r.messages or []),
            prev=previous[r.prev_item_id],
        )
        for r in rows
    ]


def start_turn(
    conn: Connection, item_id: int, messages: list[dict[str, Any]], prompt_ids: list[int]
) -> bool:
    """waiting → pending with the prompt built from the regenerated history; False if another
    advancer got there first (the update is conditional on the item still waiting)."""
    stmt = (
        update(items)
        .where(items.c.id == item_id, items.c.status == ItemStatus.WAITING.value)
        .values(
            status=ItemStatus.PENDING.value,
            messages=messages,
            prompt_ids=prompt_ids,
            prompt_tokens=len(prompt_ids),
        )
    )
    return conn.execute(stmt).rowcount == 1


def fail_waiting_chain(
    conn: Connection, run_id: int, item_key: str, sample_index: int, from_turn: int, reason: str
) -> int:
    """Fail every still-waiting turn from from_turn on of one chain (no attempt spent)."""
    stmt = (
        update(items)
        .where(
            items.c.run_id == run_id,
            items.c.item_key == item_key,
            items.c.sample_index == sample_index,
            items.c.turn_index >= from_turn,
            items.c.status == ItemStatus.WAITING.value,
        )
        .values(status=ItemStatus.FAILED.value, error=_trim(reason), finished_at=utcnow())
    )
    return conn.execute(stmt).rowcount


# --- reading results ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunCounts:
    run: str
    total: int
    pending: int
    queued: int
    leased: int
    done: int
    failed: int
    truncated: int
    output_tokens: int
    prompt_tokens: int
    # later turns of `--turns all` chains whose previous turn is not done yet
    waiting: int = 0

    @property
    def finished(self) -> bool:
        return self.pending == 0 and self.queued == 0 and self.leased == 0 and self.waiting == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "total": self.total,
            "waiting": self.waiting,
            "pending": self.pending,
            "queued": self.queued,
            "leased": self.leased,
            "done": self.done,
            "failed": self.failed,
            "truncated": self.truncated,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


def run_counts(conn: Connection, run: RunInfo) -> RunCounts:
    """The run's items by status and its token sums, read from the item counters (no scan)."""
    if run_archived(conn, run.id):  # the archive's rows left the counters with the hot table
        return _scanned_run_counts(conn, run)
    groups = counters.counted_groups(conn, run.id)
    statuses = counters.by_status(groups.items())
    tallies = groups.values()
    return RunCounts(
        run=run.name,
        total=sum(statuses.values()),
        pending=statuses.get(ItemStatus.PENDING.value, 0),
        queued=statuses.get(ItemStatus.QUEUED.value, 0),
        leased=statuses.get(ItemStatus.LEASED.value, 0),
        done=statuses.get(ItemStatus.DONE.value, 0),
        failed=statuses.get(ItemStatus.FAILED.value, 0),
        truncated=sum(t.items for k, t in groups.items() if k.finish_reason == "length"),
        output_tokens=sum(t.completion_tokens for t in tallies),
        prompt_tokens=sum(t.prompt_tokens for t in tallies),
        waiting=statuses.get(ItemStatus.WAITING.value, 0),
    )


def _scanned_run_counts(conn: Connection, run: RunInfo) -> RunCounts:
    """An archived run's items by status and token sums, counted over items and the archive."""
    by_status: dict[str, int] = {}
    trunc = out_tokens = prompt_tokens = 0
    # an archived run's rows are in the archive (and in both while it is being archived)
    for table in (items, items_archive):
        truncated = case((table.c.finish_reason == "length", 1), else_=0)
        stmt = (
            select(
                table.c.status,
                func.count(),
                func.coalesce(func.sum(truncated), 0),
                func.coalesce(func.sum(table.c.completion_tokens), 0),
                func.coalesce(func.sum(table.c.prompt_tokens), 0),
            )
            .where(table.c.run_id == run.id)
            .group_by(table.c.status)
        )
        if table is items_archive:  # rows copied and not yet deleted are counted once
            stmt = stmt.where(~select(items.c.id).where(items.c.id == table.c.id).exists())
        for status, count, t, out, prompt in conn.execute(stmt):
            by_status[status] = by_status.get(status, 0) + int(count)
            trunc += int(t)
            out_tokens += int(out)
            prompt_tokens += int(prompt)
    return RunCounts(
        run=run.name,
        total=sum(by_status.values()),
        pending=by_status.get(ItemStatus.PENDING.value, 0),
        queued=by_status.get(ItemStatus.QUEUED.value, 0),
        leased=by_status.get(ItemStatus.LEASED.value, 0),
        done=by_status.get(ItemStatus.DONE.value, 0),
        failed=by_status.get(ItemStatus.FAILED.value, 0),
        truncated=trunc,
        output_tokens=out_tokens,
        prompt_tokens=prompt_tokens,
        waiting=by_status.get(ItemStatus.WAITING.value, 0),
    )


@dataclass(frozen=True)
class StoredItem:
    id: int
    item_key: str
    sample_index: int
    status: str
    messages: list[dict[str, Any]] | None
    prompt_ids: list[int]
    output_ids: list[int] | None
    finish_reason: str | None
    completion_tokens: int | None
    attempts: int
    server: str | None
    error: str | None
    latency_s: float | None
    # the server's reported prompt count once done (len(prompt_ids) before), the stop it
    # matched (an id, a stop string or a JSON list, as text) and the conversation turn
    prompt_tokens: int | None = None
    matched_stop: str | None = None
    turn_index: int = 0
    cached_tokens: int | None = None
    # compacted: the token arrays above were read from row shard_row of this Parquet shard
    shard_uri: str | None = None
    shard_row: int | None = None
    # what else built the prompt: the row's tools and its merged kwargs (None: the run's)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # the row's fields that are not template inputs, exported with each sample
    metadata: dict[str, Any] | None = None


# StoredItem's fields that are columns of items (and of items_archive) under their own names
_STORED_FIELDS = (
    "id",
    "item_key",
    "sample_index",
    "status",
    "messages",
    "prompt_ids",
    "output_ids",
    "finish_reason",
    "completion_tokens",
    "attempts",
    "server",
    "error",
    "latency_s",
    "prompt_tokens",
    "matched_stop",
    "turn_index",
    "cached_tokens",
    "shard_uri",
    "shard_row",
    "chat_template_kwargs",
)


def _stored_select(table: Table) -> Select[Any]:
    """StoredItems of items or items_archive, with their tools list."""
    return select(
        *(table.c[name] for name in _STORED_FIELDS),
        tool_sets.c.tools.label("tools"),
        table.c.row_metadata.label("metadata"),
    ).select_from(table.outerjoin(tool_sets, tool_sets.c.id == table.c.tool_set_id))


def _hydrated(page: list[StoredItem], shards: ShardCache) -> list[StoredItem]:
    """The page with the token arrays of compacted items read back from their shards."""
    out = []
    for item in page:
        if item.shard_uri is not None and item.shard_row is not None:
            prompt_ids, output_ids = shards.arrays(item.shard_uri, item.shard_row, item.id)
            item = replace(item, prompt_ids=prompt_ids, output_ids=output_ids)
        out.append(item)
    return out


def iter_items(
    conn: Connection,
    run_id: int,
    *,
    statuses: Sequence[str] = (ItemStatus.DONE.value,),
    page_size: int = 1000,
    storage_options: dict[str, Any] | None = None,
    final_turns_only: bool = False,
) -> Iterator[StoredItem]:
    """Stream a run's items in id order, a page at a time (memory stays flat).

    Compacted items come with their real token arrays, read from their shards (with
    storage_options, default the configured ones); one row group of a shard is held at a time.
    final_turns_only: only items no later turn follows (the last turn of each chain).
    """
    from app.outputs.shards import ShardCache

    shards = ShardCache(storage_options)
    try:
        yield from _iter_items(conn, run_id, statuses, page_size, shards, final_turns_only)
    finally:
        shards.close()


def _iter_items(
    conn: Connection,
    run_id: int,
    statuses: Sequence[str],
    page_size: int,
    shards: ShardCache,
    final_turns_only: bool = False,
) -> Iterator[StoredItem]:
    streams = [
        _keyset_pages(conn, table, run_id, status, page_size, final_turns_only)
        for table in (items, items_archive)
        for status in dict.fromkeys(statuses)
    ]
    for page in merged_pages(streams, page_size):
        yield from _hydrated(page, shards)


def _keyset_pages(
    conn: Connection,
    table: Table,
    run_id: int,
    status: str,
    page_size: int,
    final_turns_only: bool,
) -> Iterator[list[StoredItem]]:
    """Pages of one status of a run in one table: `run_id = ? AND status = ? AND id > last
    ORDER BY id LIMIT n`, one range of the (run_id, status, id) index, so a page costs the
    same at row 10M as at row 0 (an IN list of statuses would read them all and sort)."""
    pin_index_plans(conn)
    after = 0
    while True:
        stmt = (
            _stored_select(table)
            .where(run_status_range(conn, table, run_id, status, after))
            .order_by(*run_status_order(table))
            .limit(page_size)
        )
        if final_turns_only:
            later = table.alias("later")
            stmt = stmt.where(
                ~select(later.c.id).where(later.c.prev_item_id == table.c.id).exists()
            )
        page = [StoredItem(**row._mapping) for row in conn.execute(stmt)]
        if not page:
            return
        yield page
        if len(page) < page_size:
            return
        after = page[-1].id


def prompt_item_ids(conn: Connection, run_id: int) -> list[int]:
    """Ids of the run's items whose prompt was rendered from messages (every turn that has
    its prompt; not pre-tokenized items, not later turns still waiting), in id order."""
    stmt = (
        select(items.c.id)
        .where(
            items.c.run_id == run_id,
            items.c.messages.is_not(None),
            items.c.status != ItemStatus.WAITING.value,
        )
        .order_by(items.c.id)
    )
    return [int(i) for i in conn.execute(stmt).scalars()]


def stored_prompts(
    conn: Connection, ids: Sequence[int], storage_options: dict[str, Any] | None = None
) -> list[StoredItem]:
    """These items with their real prompt ids (read back from shards once compacted)."""
    from app.outputs.shards import ShardCache

    shards = ShardCache(storage_options)
    try:
        return _hydrated(stored_items(conn, ids), shards)
    finally:
        shards.close()


def merged_pages(streams: Sequence[Iterator[list[Any]]], page_size: int) -> Iterator[list[Any]]:
    """Pages of rows (anything with an `id`) from id-ordered page streams, merged in id order;
    a row in two streams (a run being archived: copied, not yet deleted) comes once."""
    rows = heapq.merge(*(itertools.chain.from_iterable(s) for s in streams), key=lambda r: r.id)
    page: list[Any] = []
    last = None
    for row in rows:
        if row.id == last:
            continue
        last = row.id
        page.append(row)
        if len(page) >= page_size:
            yield page
            page = []
    if page:
        yield page


# --- compaction: token arrays of finished items moved to Parquet shards ----------------------


def _compactable(run_id: int) -> Any:
    """Done items of the run whose arrays are still in the ledger and that no unfinished later
    turn still reads (a multi-turn chain builds the next prompt from the previous turn)."""
    later = items.alias("later")
    depended_on = (
        select(later.c.id)
        .where(
            later.c.prev_item_id == items.c.id,
            later.c.status != ItemStatus.DONE.value,
            later.c.status != ItemStatus.FAILED.value,
        )
        .exists()
    )
    return and_(
        items.c.run_id == run_id,
        items.c.status == ItemStatus.DONE.value,
        items.c.shard_uri.is_(None),
        ~depended_on,
    )


def count_compactable(conn: Connection, run_id: int) -> int:
    pin_index_plans(conn)
    return int(conn.execute(select(func.count()).where(_compactable(run_id))).scalar_one())


def compactable_ids(conn: Connection, run_id: int, *, after_id: int = 0, limit: int) -> list[int]:
    """Ids of items compaction may move, in id order."""
    pin_index_plans(conn)
    stmt = (
        select(items.c.id)
        .where(_compactable(run_id), items.c.id > after_id)
        .order_by(items.c.id)
        .limit(limit)
    )
    return list(conn.execute(stmt).scalars())


def stored_items(conn: Connection, ids: Sequence[int]) -> list[StoredItem]:
    """These items as stored in the ledger (not hydrated), in id order."""
    if not ids:
        return []
    stmt = _stored_select(items).where(items.c.id.in_(list(ids))).order_by(items.c.id)
    return [StoredItem(**row._mapping) for row in conn.execute(stmt)]


_COMPACTED_TOGETHER = text(
    """
UPDATE items SET shard_uri = :uri, shard_row = v.shard_row, prompt_ids = :empty,
    output_ids = :empty
FROM unnest(CAST(:ids AS bigint[]), CAST(:rows AS integer[])) AS v(id, shard_row)
WHERE items.id = v.id AND items.shard_uri IS NULL AND items.status = 'done'
"""
)


def mark_compacted(conn: Connection, shard_uri: str, rows: Sequence[tuple[int, int]]) -> int:
    """Point items at (shard_uri, row) and empty their ledger arrays, for (item id, row) pairs;
    items already compacted are left alone. Returns how many were changed."""
    if not rows:
        return 0
    if conn.dialect.name == "postgresql":
        # one statement, not one per item: the counting trigger runs once (migration 0005e)
        together = conn.execute(
            _COMPACTED_TOGETHER,
            {
                "uri": shard_uri,
                "ids": [item_id for item_id, _ in rows],
                "rows": [row for _, row in rows],
                "empty": pack_ids([]),
            },
        )
        return int(together.rowcount)
    stmt = (
        update(items)
        .where(
            items.c.id == bindparam("b_id"),
            items.c.shard_uri.is_(None),
            items.c.status == ItemStatus.DONE.value,
        )
        .values(
            shard_uri=shard_uri,
            shard_row=bindparam("b_row"),
            prompt_ids=[],
            output_ids=[],
        )
    )
    result = conn.execute(stmt, [{"b_id": item_id, "b_row": row} for item_id, row in rows])
    return int(result.rowcount)


def shard_referenced(conn: Connection, run_id: int, name: str, first_id: int, last_id: int) -> bool:
    """Whether an item of the run (in items or the archive) points at the shard `name`, which
    holds items first_id..last_id: a primary-key range probe that stops at the first match
    (normally first_id itself), never a scan of the run."""
    for table in (items, items_archive):
        probe = select(table.c.id).where(
            table.c.id >= first_id,
            table.c.id <= last_id,
            table.c.run_id == run_id,
            table.c.shard_uri.endswith("/" + name, autoescape=True),
        )
        if conn.execute(probe.order_by(table.c.id).limit(1)).first() is not None:
            return True
    return False


def shard_uris(conn: Connection, run_id: int) -> set[str]:
    """Every shard the run's items point at."""
    stmt = select(items.c.shard_uri).where(items.c.run_id == run_id, items.c.shard_uri.is_not(None))
    return {str(u) for u in conn.execute(stmt.distinct()).scalars()}


def compacted_count(conn: Connection, run_id: int) -> int:
    stmt = select(func.count()).where(items.c.run_id == run_id, items.c.shard_uri.is_not(None))
    return int(conn.execute(stmt).scalar_one())


def runs_with_compactable(conn: Connection, min_items: int) -> list[RunInfo]:
    """Runs with at least min_items done items whose arrays are still in the ledger."""
    pin_index_plans(conn)
    stmt = (
        select(items.c.run_id)
        .where(items.c.status == ItemStatus.DONE.value, items.c.shard_uri.is_(None))
        .group_by(items.c.run_id)
        .having(func.count() >= min_items)
        .order_by(items.c.run_id)
    )
    return [get_run_by_id(conn, int(run_id)) for run_id in conn.execute(stmt).scalars()]


# --- servers and events -------------------------------------------------------------------


def record_event(
    conn: Connection,
    kind: str,
    message: str,
    *,
    run_id: int | None = None,
    server: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    conn.execute(
        insert(events).values(
            at=utcnow(), kind=kind, run_id=run_id, server=server, message=message, details=details
        )
    )
