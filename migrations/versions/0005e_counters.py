"""Item counters kept by triggers: per run, server, status and finish reason, and latency buckets.

`status`, `/metrics`, `servers` and the dashboard read item_counts and item_latency_counts
instead of counting items. Triggers on `items` keep both in the same transaction as every
insert, update and delete, whoever the writer is: on Postgres one statement-level trigger per
event aggregates the statement's transition tables into one upsert per touched key, writing the
shard of its own backend (pg_backend_pid()), so concurrent writers never wait on a counter row;
on SQLite (one writer at a time) row-level triggers upsert shard 0. The migration backfills
both tables from the existing items.

Revision ID: 0005e
Revises: 0005f
Create Date: 2026-12-01 08:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005e"
down_revision: str | None = "0005f"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# the latency histogram's fixed upper bounds, in seconds (app.ledger.counters.LATENCY_BUCKETS_S); a
# done item's bucket is the index of the first bound its latency does not exceed, or
# len(bounds) past the last one. Changing them takes a migration that recreates the triggers.
LATENCY_BOUNDS_S = (
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
)

COUNT_KEY = "run_id, server, status, finish_reason, shard"
COUNT_COLUMNS = f"{COUNT_KEY}, item_count, prompt_tokens, completion_tokens, hedged"
LATENCY_KEY = "run_id, server, bucket, shard"
LATENCY_COLUMNS = f"{LATENCY_KEY}, item_count, latency_sum_s"
TRIGGERS = ("tm_items_counted_insert", "tm_items_counted_update", "tm_items_counted_delete")


def _bucket(latency: str) -> str:
    whens = " ".join(f"WHEN {latency} <= {b!r} THEN {i}" for i, b in enumerate(LATENCY_BOUNDS_S))
    return f"CASE {whens} ELSE {len(LATENCY_BOUNDS_S)} END"


def _count_values(a: str, sign: int) -> str:
    """One item row as its contribution (sign +1 or -1) to its count key."""
    return (
        f"{a}.run_id, coalesce({a}.server, ''), {a}.status, coalesce({a}.finish_reason, ''), "
        f"{sign}, {sign} * {a}.prompt_tokens, {sign} * coalesce({a}.completion_tokens, 0), "
        f"{sign} * CASE WHEN {a}.hedge_owner IS NULL THEN 0 ELSE 1 END"
    )


def _latency_values(a: str, sign: int) -> str:
    """One item row as its contribution to its latency bucket, and whether it has one."""
    return (
        f"{a}.run_id, coalesce({a}.server, ''), {_bucket(f'{a}.latency_s')}, {sign}, "
        f"{sign} * {a}.latency_s, ({a}.status = 'done' AND {a}.latency_s IS NOT NULL)"
    )


# --- Postgres: statement-level triggers over transition tables ----------------------------

# an UPDATE changes counters only for rows whose counted columns changed (heartbeats, queue
# touches and compaction change none, and write nothing)
_PG_CHANGED = (
    "ROW(o.run_id, o.server, o.status, o.finish_reason, o.prompt_tokens, o.completion_tokens, "
    "o.hedge_owner IS NULL, o.latency_s) IS DISTINCT FROM ROW(n.run_id, n.server, n.status, "
    "n.finish_reason, n.prompt_tokens, n.completion_tokens, n.hedge_owner IS NULL, n.latency_s)"
)

# where each event's rows come from, and which sides (alias, sign) they contribute
_PG_SOURCES = {
    "INSERT": ("new_rows a", [("a", 1)], "true"),
    "UPDATE": ("old_rows o JOIN new_rows n ON n.id = o.id", [("o", -1), ("n", 1)], _PG_CHANGED),
    "DELETE": ("old_rows a", [("a", -1)], "true"),
}


def _pg_counts(source: str, sides: list[tuple[str, int]], where: str) -> str:
    values = ", ".join(f"({_count_values(a, s)})" for a, s in sides)
    return f"""
    INSERT INTO item_counts AS t ({COUNT_COLUMNS})
    SELECT d.run_id, d.server, d.status, d.finish_reason, pg_backend_pid(),
           sum(d.n), sum(d.p), sum(d.c), sum(d.h)
    FROM {source}
    CROSS JOIN LATERAL (VALUES {values}) AS d(run_id, server, status, finish_reason, n, p, c, h)
    WHERE {where}
    GROUP BY d.run_id, d.server, d.status, d.finish_reason
    HAVING (sum(d.n) <> 0 OR sum(d.p) <> 0 OR sum(d.c) <> 0 OR sum(d.h) <> 0)
       AND EXISTS (SELECT 1 FROM runs r WHERE r.id = d.run_id)
    ORDER BY 1, 2, 3, 4
    ON CONFLICT ({COUNT_KEY}) DO UPDATE SET
        item_count = t.item_count + excluded.item_count,
        prompt_tokens = t.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = t.completion_tokens + excluded.completion_tokens,
        hedged = t.hedged + excluded.hedged;"""


def _pg_latency(source: str, sides: list[tuple[str, int]], where: str) -> str:
    values = ", ".join(f"({_latency_values(a, s)})" for a, s in sides)
    return f"""
    INSERT INTO item_latency_counts AS t ({LATENCY_COLUMNS})
    SELECT d.run_id, d.server, d.bucket, pg_backend_pid(), sum(d.n), sum(d.s)
    FROM {source}
    CROSS JOIN LATERAL (VALUES {values}) AS d(run_id, server, bucket, n, s, counted)
    WHERE ({where}) AND d.counted
    GROUP BY d.run_id, d.server, d.bucket
    HAVING sum(d.n) <> 0 AND EXISTS (SELECT 1 FROM runs r WHERE r.id = d.run_id)
    ORDER BY 1, 2, 3
    ON CONFLICT ({LATENCY_KEY}) DO UPDATE SET
        item_count = t.item_count + excluded.item_count,
        latency_sum_s = t.latency_sum_s + excluded.latency_sum_s;"""


def _pg_function() -> str:
    branches: list[str] = []
    for event, (source, sides, where) in _PG_SOURCES.items():
        keyword = "IF" if not branches else "ELSIF"
        body = _pg_counts(source, sides, where) + _pg_latency(source, sides, where)
        branches.append(f"  {keyword} TG_OP = '{event}' THEN{body}")
    return (
        "CREATE FUNCTION tm_items_counted() RETURNS trigger LANGUAGE plpgsql AS $$\nBEGIN\n"
        + "\n".join(branches)
        + "\n  END IF;\n  RETURN NULL;\nEND\n$$"
    )


_PG_TRIGGERS = (
    "CREATE TRIGGER tm_items_counted_insert AFTER INSERT ON items "
    "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tm_items_counted()",
    "CREATE TRIGGER tm_items_counted_update AFTER UPDATE ON items "
    "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows "
    "FOR EACH STATEMENT EXECUTE FUNCTION tm_items_counted()",
    "CREATE TRIGGER tm_items_counted_delete AFTER DELETE ON items "
    "REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tm_items_counted()",
    # TRUNCATE fires no row events: it empties the counters with the items
    """CREATE FUNCTION tm_items_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM item_counts;
  DELETE FROM item_latency_counts;
  RETURN NULL;
END
$$""",
    "CREATE TRIGGER tm_items_counted_truncate AFTER TRUNCATE ON items "
    "FOR EACH STATEMENT EXECUTE FUNCTION tm_items_truncated()",
)


# --- SQLite: row-level triggers (one writer at a time: shard 0) ----------------------------


def _sqlite_counts(a: str, sign: int) -> str:
    # the WHERE keeps `SELECT … ON CONFLICT` unambiguous for SQLite's parser
    return f"""
  INSERT INTO item_counts ({COUNT_COLUMNS})
  SELECT {a}.run_id, coalesce({a}.server, ''), {a}.status, coalesce({a}.finish_reason, ''), 0,
         {sign}, {sign} * {a}.prompt_tokens, {sign} * coalesce({a}.completion_tokens, 0),
         {sign} * ({a}.hedge_owner IS NOT NULL)
  WHERE EXISTS (SELECT 1 FROM runs r WHERE r.id = {a}.run_id)
  ON CONFLICT ({COUNT_KEY}) DO UPDATE SET
      item_count = item_count + excluded.item_count,
      prompt_tokens = prompt_tokens + excluded.prompt_tokens,
      completion_tokens = completion_tokens + excluded.completion_tokens,
      hedged = hedged + excluded.hedged;"""


def _sqlite_latency(a: str, sign: int) -> str:
    return f"""
  INSERT INTO item_latency_counts ({LATENCY_COLUMNS})
  SELECT {a}.run_id, coalesce({a}.server, ''), {_bucket(f"{a}.latency_s")}, 0,
         {sign}, {sign} * {a}.latency_s
  WHERE {a}.status = 'done' AND {a}.latency_s IS NOT NULL
    AND EXISTS (SELECT 1 FROM runs r WHERE r.id = {a}.run_id)
  ON CONFLICT ({LATENCY_KEY}) DO UPDATE SET
      item_count = item_count + excluded.item_count,
      latency_sum_s = latency_sum_s + excluded.latency_sum_s;"""


_SQLITE_CHANGED = " OR ".join(
    [
        f"OLD.{c} IS NOT NEW.{c}"
        for c in (
            "run_id",
            "server",
            "status",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "latency_s",
        )
    ]
    + ["(OLD.hedge_owner IS NULL) IS NOT (NEW.hedge_owner IS NULL)"]
)


def _sqlite_triggers() -> list[str]:
    def both(a: str, sign: int) -> str:
        return _sqlite_counts(a, sign) + _sqlite_latency(a, sign)

    return [
        f"CREATE TRIGGER tm_items_counted_insert AFTER INSERT ON items BEGIN{both('NEW', 1)}\nEND",
        f"CREATE TRIGGER tm_items_counted_update AFTER UPDATE ON items WHEN {_SQLITE_CHANGED} "
        f"BEGIN{both('OLD', -1)}{both('NEW', 1)}\nEND",
        f"CREATE TRIGGER tm_items_counted_delete AFTER DELETE ON items BEGIN{both('OLD', -1)}\nEND",
    ]


# --- backfill ------------------------------------------------------------------------------

_BACKFILL = (
    f"""INSERT INTO item_counts ({COUNT_COLUMNS})
    SELECT run_id, coalesce(server, ''), status, coalesce(finish_reason, ''), 0, count(*),
           coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0),
           count(hedge_owner)
    FROM items GROUP BY run_id, coalesce(server, ''), status, coalesce(finish_reason, '')""",
    f"""INSERT INTO item_latency_counts ({LATENCY_COLUMNS})
    SELECT run_id, coalesce(server, ''), {_bucket("latency_s")}, 0, count(*), sum(latency_s)
    FROM items WHERE status = 'done' AND latency_s IS NOT NULL
    GROUP BY run_id, coalesce(server, ''), {_bucket("latency_s")}""",
)


def upgrade() -> None:
    op.create_table(
        "item_counts",
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("server", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("finish_reason", sa.String(length=16), nullable=False),
        sa.Column("shard", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("item_count", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("hedged", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "server", "status", "finish_reason", "shard"),
    )
    op.create_table(
        "item_latency_counts",
        sa.Column("run_id", BigId, nullable=False),
        sa.Column("server", sa.String(length=200), nullable=False),
        sa.Column("bucket", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("shard", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("item_count", sa.BigInteger(), nullable=False),
        sa.Column("latency_sum_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "server", "bucket", "shard"),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:
        # writers wait while the triggers are created and the counters filled, so that no
        # change falls between the backfill and the first trigger
        op.execute("LOCK TABLE items IN SHARE MODE")
        # few rows, each updated by every change of an item: room on the page for HOT
        # updates, and vacuumed often
        for table in ("item_counts", "item_latency_counts"):
            op.execute(
                f"ALTER TABLE {table} SET (fillfactor = 50, autovacuum_vacuum_scale_factor = 0, "
                "autovacuum_vacuum_threshold = 1000)"
            )
        op.execute(_pg_function())
        for statement in _PG_TRIGGERS:
            op.execute(statement)
    else:
        for statement in _sqlite_triggers():
            op.execute(statement)
    for statement in _BACKFILL:
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for name in (*TRIGGERS, "tm_items_counted_truncate"):
            op.execute(f"DROP TRIGGER IF EXISTS {name} ON items")
        op.execute("DROP FUNCTION IF EXISTS tm_items_counted()")
        op.execute("DROP FUNCTION IF EXISTS tm_items_truncated()")
    else:
        for name in TRIGGERS:
            op.execute(f"DROP TRIGGER IF EXISTS {name}")
    op.drop_table("item_latency_counts")
    op.drop_table("item_counts")
