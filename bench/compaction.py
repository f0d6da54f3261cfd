"""Ledger size before and after compaction: a run of done items with heavy-tailed outputs on a
private Postgres database, `pg_total_relation_size('items')` after VACUUM FULL before and after
`compact_run`, and the bytes of the Parquet shards written.

    python bench/compaction.py [--items 5000] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from common import bench_database, engine_for, machine_note
from sqlalchemy import Engine, text

from app.core.contracts import GenerateResult, SamplingParams
from app.core.settings import Settings
from app.ledger import outcomes as ledger_outcomes
from app.ledger import queue, run_queries
from workers.control.compaction import compact_run

VOCAB = 160_000


def build_run(db: Engine, items: int, rng: random.Random) -> tuple[run_queries.RunInfo, int]:
    """A run of `items` done items: prompts of 50-600 ids, outputs log-normal (median ~900)."""
    spec = run_queries.RunSpec(
        name="compaction-bench",
        tokenizer_path="/models/bench",
        tokenizer_hash="a" * 64,
        chat_template_hash="b" * 64,
        chat_template_kwargs={},
        sampling=SamplingParams(max_new_tokens=16384, seed=1),
        samples_per_prompt=1,
        think_end_id=None,
        eos_token_ids=[2],
    )
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        new = [
            queue.NewItem(
                f"p{i}",
                0,
                i,
                [{"role": "user", "content": f"question {i}"}],
                [rng.randrange(VOCAB) for _ in range(rng.randint(50, 600))],
            )
            for i in range(items)
        ]
        queue.insert_items(conn, run.id, new)
        ids = queue.pending_ids(conn, run.id, limit=items)
    tokens = 0
    for start in range(0, len(ids), 1000):
        outcomes = []
        for item_id in ids[start : start + 1000]:
            out = [rng.randrange(VOCAB) for _ in range(int(rng.lognormvariate(6.8, 0.8)))]
            tokens += len(out)
            result = GenerateResult("bench", out, "stop", None, 0, len(out), 0, 1.0)
            outcomes.append(ledger_outcomes.Done(item_id, result))
        with db.begin() as conn:
            ledger_outcomes.record_outcomes(conn, outcomes, owner="bench", lease_s=60)
    return run, tokens


def items_bytes(db: Engine) -> int:
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM FULL items"))
        return int(conn.execute(text("SELECT pg_total_relation_size('items')")).scalar_one())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(machine_note())
    with bench_database() as url, tempfile.TemporaryDirectory() as tmp:
        db = engine_for(url)
        run, tokens = build_run(db, args.items, random.Random(args.seed))
        before = items_bytes(db)
        settings = Settings(data_dir=Path(tmp), storage_url=Path(tmp, "storage").as_uri())
        started = time.monotonic()
        report = compact_run(db, settings, run, force=True)
        took = time.monotonic() - started
        after = items_bytes(db)
        shards = sum(p.stat().st_size for p in Path(tmp, "storage").rglob("*.parquet"))
        db.dispose()
    print(f"{args.items} done items, {tokens} output tokens (random ids: zstd gains little)")
    print(f"compacted {report.compacted} items into {len(report.shards)} shards in {took:.1f} s")
    print(
        f"pg_total_relation_size('items') after VACUUM FULL: {before / 1e6:.1f} MB before, "
        f"{after / 1e6:.1f} MB after ({after / before:.1%})"
    )
    print(f"Parquet shards (zstd): {shards / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
