"""The broker side of bench/scale.py's ledgers: the Redis database the scale benchmarks publish
to, and run B's oldest queued ids put in broker messages as an enqueue leaves them.

Imported first by bench/scale.py: it points the product's broker setting at that database
before anything imports app.celery_app.
"""

from __future__ import annotations

import os
import time

REDIS_URL = os.environ.get("TOKENMILL_BENCH_SCALE_REDIS_URL", "redis://127.0.0.1:6379/14")
# the product reads its settings (the broker for publishing) from the environment: set it
# before app.celery_app is imported
os.environ["TOKENMILL_BROKER_URL"] = REDIS_URL

import scale_build as build  # noqa: E402
from common import flush_redis  # noqa: E402
from sqlalchemy import Engine, text  # noqa: E402

BROKER_FILL_IDS = 200_000  # run B's first ids, in broker messages as after an enqueue


def fill_broker(db: Engine, built: build.Ledger) -> None:
    """Messages for run B's oldest BROKER_FILL_IDS queued ids (all of them up to 1M items):
    what reconcile's bounded check reads first. Publishing 2M ids would take 10 minutes."""
    from workers.intake.publish import publish_items

    flush_redis(REDIS_URL)
    after, started = 0, time.monotonic()
    while after == 0 or after < _nth_queued(db, built, BROKER_FILL_IDS):
        ids = queued_ids(db, built, after, 50_000)
        if not ids:
            break
        publish_items(ids, batch_size=32, run=build.RUN_B)
        after = ids[-1]
    print(f"  broker filled in {time.monotonic() - started:.0f}s", flush=True)


def queued_ids(db: Engine, built: build.Ledger, after: int, limit: int) -> list[int]:
    """Run B's queued ids above after, in id order (the bench's own pick, not a product query)."""
    with db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id FROM items WHERE run_id = :run AND status = 'queued' AND id > :after "
                "ORDER BY id LIMIT :n"
            ),
            {"run": built.run_b.id, "after": after, "n": limit},
        )
        return [int(i) for i in rows.scalars()]


def _nth_queued(db: Engine, built: build.Ledger, n: int) -> int:
    with db.connect() as conn:
        last = conn.execute(
            text(
                "SELECT max(id) FROM (SELECT id FROM items WHERE run_id = :run "
                "AND status = 'queued' ORDER BY id LIMIT :n) AS first"
            ),
            {"run": built.run_b.id, "n": n},
        ).scalar()
    return int(last or 0)
