"""A synthetic Postgres ledger for query plans: two runs filled by generate_series (no
tokenizer), with the end of one run (leases on two servers, nothing left to claim) while the
other is still queued; the statistics can be left as they were right after the enqueue."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text

from app.ledger import run_queries
from tests.support.runs import make_run

LEASED = 1000
UNCOMPACTED = 2000


@dataclass(frozen=True)
class Ledger:
    ending: run_queries.RunInfo  # done (mostly compacted), failed, leased: nothing left to claim
    queued: run_queries.RunInfo  # every item queued long ago
    leased: int


def fill(conn: Connection, *, ending_items: int, queued_items: int, stale: bool) -> Ledger:
    """Insert both runs as pending, ANALYZE, then move them to their states; with stale, the
    planner keeps the statistics of the enqueue (everything pending), else ANALYZE again."""
    ending = make_run(conn, "synthetic-ending")
    queued = make_run(conn, "synthetic-queued")
    insert = text(
        "INSERT INTO items (run_id, item_key, sample_index, turn_index, prompt_ids, "
        "prompt_tokens, status, attempts, created_at) "
        "SELECT :run, 'k' || g, 0, 0, '\\x01000000'::bytea, 1, 'pending', 0, now() "
        "FROM generate_series(1, :n) AS g"
    )
    conn.execute(insert, {"run": ending.id, "n": ending_items})
    conn.execute(insert, {"run": queued.id, "n": queued_items})
    conn.execute(text("ANALYZE items"))
    first = conn.execute(
        text("SELECT min(id) FROM items WHERE run_id = :r"), {"r": ending.id}
    ).scalar_one()
    # what is active stays the same at any size: the leases and the done items not yet
    # compacted; the rest of the run is compacted (and 1% failed)
    n = ending_items
    leased, uncompacted, failed = LEASED, UNCOMPACTED, n // 100
    compacted = n - leased - uncompacted - failed
    done_sql = (
        "UPDATE items SET status = 'done', server = CASE WHEN id % 2 = 0 THEN 'gpu-a' "
        "ELSE 'gpu-b' END, started_at = now() - interval '2 hours', "
        "finished_at = now() - interval '1 hour' + id * interval '1 ms', completion_tokens = 9, "
        "latency_s = 1.5, finish_reason = 'stop', attempts = 1 "
    )
    conn.execute(
        text(
            done_sql + ", shard_uri = 'file:///s/items-' || (:lo)::text || '.parquet', "
            "shard_row = id - :lo, prompt_ids = '\\x'::bytea WHERE run_id = :r AND id < :lo + :k"
        ),
        {"r": ending.id, "lo": first, "k": compacted},
    )
    conn.execute(
        text(
            done_sql + ", output_ids = '\\x02000000'::bytea WHERE run_id = :r AND id >= :a "
            "AND id < :b"
        ),
        {"r": ending.id, "a": first + compacted, "b": first + compacted + uncompacted},
    )
    after_done = first + compacted + uncompacted
    conn.execute(
        text(
            "UPDATE items SET status = 'failed', error = 'HTTP 400', finished_at = now(), "
            "attempts = 1 WHERE run_id = :r AND id >= :a AND id < :b"
        ),
        {"r": ending.id, "a": after_done, "b": after_done + failed},
    )
    conn.execute(
        text(
            "UPDATE items SET status = 'leased', server = CASE WHEN id % 2 = 0 THEN 'gpu-a' "
            "ELSE 'gpu-b' END, lease_owner = CASE WHEN id % 2 = 0 THEN 'worker-a' "
            "ELSE 'worker-b' END, lease_expires_at = now() + interval '10 minutes', "
            "started_at = now() - interval '1 minute', queued_at = now() - interval '1 hour' "
            "WHERE run_id = :r AND id >= :a"
        ),
        {"r": ending.id, "a": after_done + failed},
    )
    conn.execute(
        text(
            "UPDATE items SET status = 'queued', queued_at = now() - interval '1 hour' "
            "WHERE run_id = :r"
        ),
        {"r": queued.id},
    )
    if not stale:
        conn.execute(text("ANALYZE items"))
    return Ledger(ending=ending, queued=queued, leased=leased)
