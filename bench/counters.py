"""Item counters at scale: what status, servers and a /metrics scrape cost when they read the
counters, against counting the items; and what the triggers add to a claim and a result write.

    python bench/counters.py [--sizes 100000,1000000] [--rounds 200]

Per size, a private Postgres database gets two runs (the second a tenth of the first) of
synthetic items: 90% done (stop or length, latencies 0.1-4000 s), 4% failed, 3% leased on
three servers, 3% queued, inserted by one INSERT … SELECT (the triggers count them). Times are
medians of repeated calls. The write path is timed with the triggers on and off
(`ALTER TABLE items DISABLE TRIGGER USER`), alternating, in the same database.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from common import bench_database, engine_for, machine_note, table
from sqlalchemy import Connection, Engine, text

from app.core.contracts import GenerateResult, SamplingParams
from app.ledger import claims, counters, metrics_queries, queue, reads, run_queries
from app.ledger import outcomes as ledger_outcomes

SERVERS = ("gpu-a", "gpu-b", "gpu-c")

# one row per item: the status, server and numbers follow from the item's number g
_FILL = """
INSERT INTO items (run_id, item_key, sample_index, turn_index, prompt_ids, prompt_tokens, status,
                   attempts, server, finish_reason, completion_tokens, latency_s, created_at,
                   started_at, finished_at, lease_owner, lease_expires_at)
SELECT :run_id, 'k' || g, 0, 0, '\\x0100000002000000'::bytea, 50 + g % 500,
       CASE WHEN g % 100 < 90 THEN 'done' WHEN g % 100 < 94 THEN 'failed'
            WHEN g % 100 < 97 THEN 'leased' ELSE 'queued' END,
       1,
       CASE WHEN g % 100 < 97 THEN (ARRAY['gpu-a', 'gpu-b', 'gpu-c'])[1 + g % 3] END,
       CASE WHEN g % 100 < 90 THEN (CASE WHEN g % 17 = 0 THEN 'length' ELSE 'stop' END) END,
       CASE WHEN g % 100 < 90 THEN 100 + g % 3000 END,
       CASE WHEN g % 100 < 90 THEN 0.1 + (g % 40000) / 10.0 END,
       now(), now(), CASE WHEN g % 100 < 94 THEN now() END,
       CASE WHEN g % 100 BETWEEN 94 AND 96 THEN 'dead-worker' END,
       CASE WHEN g % 100 BETWEEN 94 AND 96 THEN now() + interval '1 hour' END
FROM generate_series(1, :n) AS g
"""


def make_run(conn: Connection, name: str) -> run_queries.RunInfo:
    spec = run_queries.RunSpec(
        name=name,
        tokenizer_path="/models/bench",
        tokenizer_hash="a" * 64,
        chat_template_hash="b" * 64,
        chat_template_kwargs={},
        sampling=SamplingParams(max_new_tokens=4096, seed=1),
        samples_per_prompt=1,
        think_end_id=None,
        eos_token_ids=[2],
    )
    run, _ = run_queries.get_or_create_run(conn, spec)
    return run


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def read_costs(db: Engine, runs: list[run_queries.RunInfo], repeat: int) -> list[tuple[str, float]]:
    """Median ms of each view's reads from the counters, and of the full counts they replace."""

    def on_conn(fn: Callable[[Connection], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with db.connect() as conn:
                return fn(conn)

        return call

    cases: list[tuple[str, bool, Callable[[], Any]]] = [
        (
            "status: run_counts of both runs",
            True,
            on_conn(lambda c: [reads.run_counts(c, r) for r in runs]),
        ),
        ("servers: leased per server", True, on_conn(counters.leased_by_server)),
        ("/metrics: the whole ledger snapshot", True, lambda: metrics_queries.read_snapshot(db)),
        (
            "full count: groups (what status/metrics scanned)",
            False,
            on_conn(counters.scanned_groups),
        ),
        ("full count: latency buckets", False, on_conn(counters.scanned_latencies)),
        ("verify --counts (both, one snapshot)", False, lambda: counters.check(db)),
    ]
    return [(name, median_ms(fn, repeat if cheap else 3)) for name, cheap, fn in cases]


def write_costs(db: Engine, rounds: int, batch: int) -> dict[bool, tuple[float, float, float]]:
    """Median ms of enqueue (insert + mark queued), claim and result write of `batch` new
    items, with the triggers on and off, alternating round by round."""
    with db.begin() as conn:
        run = make_run(conn, "hot")
    timings: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
    for i in range(rounds):
        on = i % 2 == 0
        with db.begin() as conn:
            conn.execute(text(f"ALTER TABLE items {'ENABLE' if on else 'DISABLE'} TRIGGER USER"))
        new = [queue.NewItem(f"h{i}-{j}", 0, j, None, list(range(300))) for j in range(batch)]
        t0 = time.perf_counter()
        with db.begin() as conn:
            queue.insert_items(conn, run.id, new)
            ids = queue.pending_ids(conn, run.id, limit=batch)
            queue.mark_queued(conn, ids)
        t1 = time.perf_counter()
        with db.begin() as conn:
            claimed = claims.claim_items(conn, ids, owner="w", server="gpu-a", lease_s=600)
        t2 = time.perf_counter()
        outcomes: list[ledger_outcomes.Outcome] = [
            ledger_outcomes.Done(c.id, GenerateResult("b", [5] * 64, "stop", 2, 300, 64, 0, 1.5))
            for c in claimed
        ]
        with db.begin() as conn:
            ledger_outcomes.record_outcomes(conn, outcomes, owner="w", lease_s=600)
        t3 = time.perf_counter()
        timings[on].append(((t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000))
    with db.begin() as conn:
        conn.execute(text("ALTER TABLE items ENABLE TRIGGER USER"))
        counters.repair(conn)  # the rounds without triggers were not counted
    return {
        on: tuple(statistics.median(t[k] for t in rows) for k in range(3))  # type: ignore[misc]
        for on, rows in timings.items()
    }


def bench_size(n: int, rounds: int, batch: int, repeat: int) -> None:
    with bench_database() as url:
        db = engine_for(url)
        try:
            with db.begin() as conn:
                runs = [make_run(conn, "big"), make_run(conn, "small")]
            start = time.perf_counter()
            for run, count in zip(runs, (n, n // 10), strict=True):
                with db.begin() as conn:
                    conn.execute(text(_FILL), {"run_id": run.id, "n": count})
            fill_s = time.perf_counter() - start
            with db.begin() as conn:
                conn.execute(text("ANALYZE"))
                counter_rows = conn.execute(text("SELECT count(*) FROM item_counts")).scalar_one()
            total = n + n // 10
            print(
                f"\n## {total:,} items (two runs), filled in {fill_s:.1f} s, "
                f"{counter_rows} counter rows"
            )
            print(table(["read", "median ms"], read_costs(db, runs, repeat)))
            writes = write_costs(db, rounds, batch)
            rows = [
                (f"{what} of {batch} items", writes[True][k], writes[False][k])
                for k, what in enumerate(("enqueue (COPY + mark queued)", "claim", "result write"))
            ]
            print(table(["write", "triggers on ms", "off ms"], rows))
        finally:
            db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes", default="100000,1000000", help="items of the big run, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=200, help="write rounds (half with triggers)")
    parser.add_argument("--batch", type=int, default=32, help="items per claim and write")
    parser.add_argument("--repeat", type=int, default=20, help="calls per counter read")
    args = parser.parse_args()
    print(machine_note())
    for size in (int(s) for s in args.sizes.split(",")):
        bench_size(size, args.rounds, args.batch, args.repeat)


if __name__ == "__main__":
    main()
