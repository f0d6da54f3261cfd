"""Builds the ledgers of bench/scale.py: one Postgres database per size, at the latest
migration, filled with synthetic items by a server-side bulk insert (no tokenizer).

The mix is the end of a run with another queued behind it (issue 14's worst case):
- run `scale-a` (80% of the items, each rendered from one user turn): done (3% truncated),
  0.2% failed, 256 leased to two live workers, 64 leased to a dead worker whose leases
  expired an hour ago;
- run `scale-b` (20%, pre-tokenized): queued for 30 minutes behind it, every id in a broker
  message;
- run `scale-c`: 10,000 done items, the last ids of the table (the export and verify subject).
Runs, servers, fingerprints and events are written with the product's own functions; the
items are written in bulk with the items table's indexes and constraints dropped and then
re-created from their own definitions (pg_indexes, pg_constraint), so the schema stays exactly
the migrations'. Token arrays are short (8 prompt ids, 8–16 output ids) so 10M rows fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from common import PG_ADMIN_URL, engine_for
from sqlalchemy import Connection, Engine, create_engine, text

from app.core.contracts import SamplingParams
from app.core.settings import normalize_database_url
from app.ledger import common, event_log, migrate, queue, registry, run_queries

RUN_A, RUN_B, RUN_C = "scale-a", "scale-b", "scale-c"
EXPORT_ITEMS = 10_000
LIVE_LEASES = 256  # two live workers, 128 in flight each
DEAD_LEASES = 64  # a dead worker's leases, expired an hour ago
SERVERS = ("s1", "s2", "s3")  # s3 holds no lease: the idle server that looks for hedges
LIVE_WORKERS = ("gen@s1-host", "gen@s2-host")
DEAD_WORKER = "gen@dead-host"
MAX_NEW_TOKENS = 16
EOS_ID = 163586
CHUNK_ROWS = 1_000_000
EVENTS = 1_000


@dataclass(frozen=True)
class Ledger:
    """A built ledger: its database URL (plain postgresql://) and its three runs."""

    size: int
    url: str
    run_a: run_queries.RunInfo
    run_b: run_queries.RunInfo
    run_c: run_queries.RunInfo


def database_name(size: int) -> str:
    return f"tokenmill_scale_{size}"


def database_url(size: int) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{database_name(size)}"


def _admin() -> Engine:
    return create_engine(normalize_database_url(PG_ADMIN_URL), isolation_level="AUTOCOMMIT")


def _marker(size: int) -> str:
    return f"tokenmill scale ledger: {size} items at revision {migrate.declared_head()}"


def existing(size: int) -> Ledger | None:
    """The ledger of this size if a previous --keep run built it at the current revision."""
    admin = _admin()
    try:
        with admin.connect() as conn:
            comment = conn.execute(
                text(
                    "SELECT shobj_description(oid, 'pg_database') FROM pg_database "
                    "WHERE datname = :name"
                ),
                {"name": database_name(size)},
            ).scalar()
    finally:
        admin.dispose()
    if comment != _marker(size):
        return None
    return _open(size)


def forget(size: int) -> None:
    """Mark a kept ledger as changed (a fleet ran on it): the next --keep builds it again."""
    admin = _admin()
    try:
        with admin.connect() as conn:
            conn.execute(text(f'COMMENT ON DATABASE "{database_name(size)}" IS NULL'))
    finally:
        admin.dispose()


def drop(size: int) -> None:
    admin = _admin()
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database_name(size)}" WITH (FORCE)'))
    finally:
        admin.dispose()


def _open(size: int) -> Ledger:
    db = engine_for(database_url(size))
    try:
        with db.connect() as conn:
            runs = {name: run_queries.get_run(conn, name) for name in (RUN_A, RUN_B, RUN_C)}
    finally:
        db.dispose()
    return Ledger(size, database_url(size), runs[RUN_A], runs[RUN_B], runs[RUN_C])


def build(size: int, tokenizer_dir: str, tokenizer_hash: str, template_hash: str) -> Ledger:
    """A fresh ledger of `size` items in runs A and B (plus run C's), replacing any other."""
    started = time.monotonic()
    drop(size)
    admin = _admin()
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{database_name(size)}"'))
    finally:
        admin.dispose()
    db = engine_for(database_url(size))
    try:
        migrate.upgrade(db)
        now = common.utcnow()
        with db.begin() as conn:
            runs = [
                _create_run(conn, name, tokenizer_dir, tokenizer_hash, template_hash)
                for name in (RUN_A, RUN_B, RUN_C)
            ]
            for name in SERVERS:
                registry.upsert_server(conn, name, f"http://127.0.0.1:{30000 + int(name[1:])}")
            for name, worker in zip(SERVERS, LIVE_WORKERS, strict=False):
                registry.set_workers(conn, name, [worker])
            for i in range(EVENTS):
                event_log.record_event(
                    conn, "probe", f"synthetic event {i}", server=SERVERS[i % len(SERVERS)]
                )
        a_items = round(size * 0.8)
        with db.begin() as conn:
            constraints = _drop_constraints_and_indexes(conn)
        a_row = _finishing_row(a_items, leases=True)
        insert_items(db, runs[0].id, a_items, a_row, now, messages=_MESSAGES)
        insert_items(db, runs[1].id, size - a_items, QUEUED_ROW, now)
        insert_items(db, runs[2].id, EXPORT_ITEMS, _finishing_row(EXPORT_ITEMS, leases=False), now)
        print(f"  {size:,}: rows inserted after {time.monotonic() - started:.0f}s", flush=True)
        with db.begin() as conn:
            for ddl in constraints:
                conn.execute(text(ddl))
        print(f"  {size:,}: indexes built after {time.monotonic() - started:.0f}s", flush=True)
        with db.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM items"))
        with db.begin() as conn:
            queue.refresh_statistics(conn)
            comment = _marker(size).replace("'", "''")
            conn.execute(text(f"COMMENT ON DATABASE \"{database_name(size)}\" IS '{comment}'"))
    finally:
        db.dispose()
    print(f"  {size:,}: built in {time.monotonic() - started:.0f}s", flush=True)
    return _open(size)


def _create_run(
    conn: Connection, name: str, tokenizer_dir: str, tokenizer_hash: str, template_hash: str
) -> run_queries.RunInfo:
    spec = run_queries.RunSpec(
        name=name,
        tokenizer_path=tokenizer_dir,
        tokenizer_hash=tokenizer_hash,
        chat_template_hash=template_hash,
        chat_template_kwargs={},
        sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.7, seed=1),
        samples_per_prompt=4,
        think_end_id=None,
        eos_token_ids=[EOS_ID],
    )
    run, _ = run_queries.get_or_create_run(conn, spec)
    fingerprint = {"model_path": "synthetic/model", "weight_version": "1", "version": "0.0"}
    run_queries.pin_fingerprint(conn, run.id, fingerprint)
    return run


def _drop_constraints_and_indexes(conn: Connection) -> list[str]:
    """Drop every index and key of items (and foreign keys pointing at it); return the DDL
    that re-creates them exactly, in a valid order."""
    foreign = conn.execute(
        text(
            "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
            "FROM pg_constraint WHERE contype = 'f' "
            "AND (conrelid = 'items'::regclass OR confrelid = 'items'::regclass)"
        )
    ).all()
    keys = conn.execute(
        text(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = 'items'::regclass AND contype IN ('p', 'u')"
        )
    ).all()
    key_names = {name for name, _ in keys}
    indexes = [
        (name, ddl)
        for name, ddl in conn.execute(
            text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'items'")
        )
        if name not in key_names
    ]
    for table, name, _ in foreign:
        conn.execute(text(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"'))
    for name, _ in keys:
        conn.execute(text(f'ALTER TABLE items DROP CONSTRAINT "{name}"'))
    for name, _ in indexes:
        conn.execute(text(f'DROP INDEX "{name}"'))
    return (
        [f'ALTER TABLE items ADD CONSTRAINT "{name}" {ddl}' for name, ddl in keys]
        + [ddl for _, ddl in indexes]
        + [f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {ddl}' for table, name, ddl in foreign]
    )


# Row g (1-based within its run) of each run, as SQL over generate_series(:lo, :hi) AS g.
# Arrays are packed little-endian int32 ids, as app.core.models.TokenArray stores them.
_PROMPT = "decode(repeat('2a000000', 8), 'hex')"
_STOP_OUTPUT = (
    "decode(repeat('07000000', (7 + g % 8)::int) || 'c27e0200', 'hex')"  # ends with EOS_ID 163586
)
_LENGTH_OUTPUT = f"decode(repeat('07000000', {MAX_NEW_TOKENS}), 'hex')"


def _finishing_row(total: int, *, leases: bool) -> str:
    """A run at its end: done, 0.2% failed, 3% truncated; with leases, its last ids leased
    (live workers', then the dead worker's)."""
    live_from = total - (LIVE_LEASES + DEAD_LEASES if leases else 0)
    dead_from = total - (DEAD_LEASES if leases else 0)
    status = (
        f"CASE WHEN g > {live_from} THEN 'leased' WHEN g % 500 = 0 THEN 'failed' ELSE 'done' END"
    )
    done = f"g <= {live_from} AND g % 500 <> 0"
    length = f"{done} AND g % 33 = 0"
    # finished over the last ten hours, in id order
    finished = (
        f"CASE WHEN g <= {live_from} "
        f"THEN :now - (({total} - g) * interval '10 hours' / {total}) END"
    )
    return f"""
        {status} AS status,
        CASE WHEN g > {live_from} THEN 1 ELSE 1 + (g % 500 = 0)::int * 4 END AS attempts,
        CASE WHEN g > {dead_from} THEN '{DEAD_WORKER}'
             WHEN g > {live_from} THEN (ARRAY{list(LIVE_WORKERS)})[1 + g % 2] END AS lease_owner,
        CASE WHEN g > {dead_from} THEN :now - interval '1 hour'
             WHEN g > {live_from} THEN :now + interval '1 hour' END AS lease_expires_at,
        CASE WHEN g > {dead_from} THEN 's2' ELSE 's' || (1 + g % 2) END AS server,
        CASE WHEN g % 500 = 0 AND g <= {live_from}
             THEN 'the server rejected the request: synthetic failure' END AS error,
        CASE WHEN {length} THEN {_LENGTH_OUTPUT} WHEN {done} THEN {_STOP_OUTPUT} END AS output_ids,
        CASE WHEN {length} THEN 'length' WHEN {done} THEN 'stop' END AS finish_reason,
        CASE WHEN {done} AND NOT ({length}) THEN '{EOS_ID}' END AS matched_stop,
        CASE WHEN {length} THEN {MAX_NEW_TOKENS} WHEN {done} THEN 8 + g % 8 END
            AS completion_tokens,
        CASE WHEN {done} THEN 0 END AS cached_tokens,
        CASE WHEN {done} THEN 0.5 + (g % 97) * 0.37 END AS latency_s,
        :now - interval '11 hours' AS queued_at,
        CASE WHEN g > {dead_from} THEN :now - interval '2 hours'
             WHEN g > {live_from} THEN :now - (g % 60) * interval '1 second'
             ELSE {finished} - (0.5 + (g % 97) * 0.37) * interval '1 second' END AS started_at,
        {finished} AS finished_at
    """


QUEUED_ROW = """
        'queued' AS status, 0 AS attempts, NULL AS lease_owner, NULL::timestamptz AS
        lease_expires_at, NULL AS server, NULL AS error, NULL::bytea AS output_ids,
        NULL AS finish_reason, NULL AS matched_stop, NULL::int AS completion_tokens,
        NULL::int AS cached_tokens, NULL::float AS latency_s,
        :now - interval '30 minutes' AS queued_at, NULL::timestamptz AS started_at,
        NULL::timestamptz AS finished_at
"""


# run A's prompts were rendered from one user turn (what the parity preflight samples); runs B
# and C are pre-tokenized (no messages)
_MESSAGES = """CAST('[{"role": "user", "content": "prompt ' || g || '"}]' AS json)"""


def insert_items(
    db: Engine, run_id: int, count: int, row_sql: str, now: datetime, *, messages: str = "NULL"
) -> None:
    """count items of run_id, in chunks (one transaction each), ids in g order."""
    for lo in range(1, count + 1, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS - 1, count)
        stmt = f"""
            INSERT INTO items (run_id, item_key, sample_index, turn_index, line_no, messages,
                prompt_ids, prompt_tokens, status, attempts, lease_owner, lease_expires_at, server,
                error, output_ids, finish_reason, matched_stop, completion_tokens, cached_tokens,
                latency_s, queued_at, started_at, finished_at, created_at)
            SELECT :run_id, 'p' || ((g - 1) / 4), (g - 1) % 4, 0, (g - 1) / 4 + 1, {messages},
                {_PROMPT}, 8, s.status, s.attempts, s.lease_owner, s.lease_expires_at, s.server,
                s.error, s.output_ids, s.finish_reason, s.matched_stop, s.completion_tokens,
                s.cached_tokens, s.latency_s, s.queued_at, s.started_at, s.finished_at,
                :now - interval '11 hours'
            FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g,
                LATERAL (SELECT {row_sql}) AS s
            ORDER BY g
        """
        with db.begin() as conn:
            conn.execute(text(stmt), {"run_id": run_id, "lo": lo, "hi": hi, "now": now})
