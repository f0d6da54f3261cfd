"""The parity preflight's sample of a run's prompts (ledger.sample_prompt_item_ids), on SQLite
and Postgres: seeded, distinct, only items rendered from messages, from the hot table and the
archive; a large run is sampled through the indexes (its plans on Postgres never scan)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine

from app.core.settings import Settings
from app.ledger import archive, queue, reads, run_queries
from tests.integration.test_query_plans import assert_indexed, plans_of
from tests.support.done_runs import make_done_run, spec
from workers.control.compaction import compact_run

BIG = 3 * reads.SAMPLE_SCAN_IDS  # sampled through the indexes, not read whole


def make_run(db: Engine, name: str, rows: int, *, every_prompt: int = 1) -> run_queries.RunInfo:
    """A run of `rows` items; every `every_prompt`th is rendered from messages, the rest are
    pre-tokenized, and every 10th of those a later turn still waiting."""
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec(name))
        queue.insert_items(
            conn,
            run.id,
            [
                queue.NewItem(
                    f"k{i}",
                    0,
                    i + 1,
                    [{"role": "user", "content": f"q{i}"}] if i % every_prompt == 0 else None,
                    [1, 2, i],
                    waiting=i % every_prompt != 0 and i % 10 == 1,
                    turn_index=1 if i % every_prompt != 0 and i % 10 == 1 else 0,
                )
                for i in range(rows)
            ],
        )
    return run


def test_a_large_run_is_sampled_with_the_seed(db: Engine) -> None:
    run = make_run(db, "big", BIG, every_prompt=3)
    with db.connect() as conn:
        every = set(reads.prompt_item_ids(conn, run.id))
        drawn = reads.sample_prompt_item_ids(conn, run.id, 8, seed=7)
        assert len(drawn) == 8 and drawn == sorted(set(drawn)) and set(drawn) <= every
        assert reads.sample_prompt_item_ids(conn, run.id, 8, seed=7) == drawn
        others = [reads.sample_prompt_item_ids(conn, run.id, 8, seed=s) for s in range(6)]
        assert any(o != drawn for o in others)
        assert len(reads.sample_prompt_item_ids(conn, run.id, 200, seed=1)) == 200
        assert reads.sample_prompt_item_ids(conn, run.id, 0, seed=1) == []


def test_a_small_run_is_read_whole(db: Engine) -> None:
    run = make_run(db, "small", 40, every_prompt=2)
    with db.connect() as conn:
        every = reads.prompt_item_ids(conn, run.id)
        assert len(every) == 20
        assert reads.sample_prompt_item_ids(conn, run.id, 50, seed=0) == every
        drawn = reads.sample_prompt_item_ids(conn, run.id, 5, seed=3)
        assert len(drawn) == 5 and set(drawn) <= set(every)
        assert reads.sample_prompt_item_ids(conn, run.id, 5, seed=3) == drawn


def test_a_pre_tokenized_run_gives_nothing_and_a_missing_run_nothing(db: Engine) -> None:
    run = make_run(db, "ids", BIG, every_prompt=BIG + 1)  # only item 0 has messages
    with db.connect() as conn:
        assert reads.prompt_item_ids(conn, run.id) != []
        drawn = reads.sample_prompt_item_ids(conn, run.id, 8, seed=1)
        assert set(drawn) <= set(reads.prompt_item_ids(conn, run.id))
        assert reads.sample_prompt_item_ids(conn, 10**9, 8, seed=1) == []


def test_an_archived_run_is_sampled_from_the_archive(db: Engine, tmp_path: Path) -> None:
    run = make_done_run(db, "arch", reads.SAMPLE_SCAN_IDS, extra=False)
    settings = Settings(
        data_dir=tmp_path / "data",
        storage_url=(tmp_path / "storage").as_uri(),
        compact_min_items=1,
    )
    with db.connect() as conn:
        before = reads.sample_prompt_item_ids(conn, run.id, 8, seed=5)
    compact_run(db, settings, run, force=True)
    archive.archive_run(db, settings, run)
    with db.connect() as conn:
        assert run_queries.run_archived(conn, run.id)
        assert reads.sample_prompt_item_ids(conn, run.id, 8, seed=5) == before
        assert len(before) == 8


def test_the_sample_reads_indexes_only(pg_engine: Engine) -> None:
    run = make_run(pg_engine, "plans", BIG, every_prompt=3)
    with pg_engine.connect() as conn:
        plans = plans_of(conn, lambda c: reads.sample_prompt_item_ids(c, run.id, 8, seed=2))
    assert len(plans) <= 1 + 4  # the id range, then one statement a round
    assert_indexed(plans, "ix_items_run_status_id", "items_pkey")
