"""The item counters equal a full count of the items after every kind of state change, on SQLite
and Postgres, with concurrent writers on Postgres; `verify --counts` finds drift and repairs it.

The full count (`counters.scanned_*`) reads the items themselves, never the counters.
"""

from __future__ import annotations

import importlib
import json
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from alembic import command
from click.testing import CliRunner
from sqlalchemy import Connection, Engine, create_engine, delete, func, insert, select, text, update

from app.core.contracts import GenerateResult, SamplingParams
from app.core.settings import get_settings
from app.ledger import (
    claims,
    common,
    compaction,
    counters,
    database,
    metrics_queries,
    migrate,
    queue,
    reads,
    run_queries,
    turns,
)
from app.ledger import outcomes as ledger_outcomes
from ops.cli import cli
from tests.conftest import PG_ADMIN_URL
from tests.support import runs as support_runs
from tests.support.procs import clean_env


def result(n: int, *, finish: str = "stop", latency_s: float = 2.0) -> GenerateResult:
    ids = list(range(100, 100 + n))
    return GenerateResult("rid", ids, finish, ids[-1], 4, n, 0, latency_s)  # type: ignore[arg-type]


def assert_exact(conn: Connection) -> None:
    assert counters.find_drift(conn) == []


def new_items(run: run_queries.RunInfo, n: int, *, prefix: str = "k") -> list[queue.NewItem]:
    return [queue.NewItem(f"{prefix}{i}", 0, i + 1, None, [1, 2, 3, 4]) for i in range(n)]


# --- every state change, on both databases ----------------------------------------------------


def test_every_state_change_keeps_the_counters_exact(db: Engine) -> None:
    with db.begin() as conn:
        run = support_runs.make_run(conn, "c1")
        assert queue.insert_items(conn, run.id, new_items(run, 10)) == 10
        # a second enqueue of the same keys inserts nothing and counts nothing
        assert queue.insert_items(conn, run.id, new_items(run, 10)) == 0
        # a `--turns all` chain: a later turn inserted waiting, then linked
        waiting = queue.NewItem("k0", 0, 1, None, [], turn_index=1, waiting=True)
        assert queue.insert_items(conn, run.id, [waiting]) == 1
        turns.link_turns(conn, run.id, ["k0"])
        assert_exact(conn)
        counts = reads.run_counts(conn, run)
        assert (counts.total, counts.pending, counts.waiting, counts.prompt_tokens) == (
            11,
            10,
            1,
            40,
        )

        ids = queue.pending_ids(conn, run.id)
        assert queue.mark_queued(conn, ids[:8]) == 8
        assert_exact(conn)
        a = claims.claim_items(conn, ids[:4], owner="wa", server="gpu-a", lease_s=600)
        b = claims.claim_next(conn, owner="wb", server="gpu-b", lease_s=600, limit=3)
        assert len(a) == 4 and len(b) == 3
        # a redelivered message claims nothing and counts nothing
        assert claims.claim_items(conn, ids[:4], owner="wc", server="gpu-c", lease_s=600) == []
        claims.extend_leases(conn, owner="wa", lease_s=900)  # heartbeat: no counted change
        queue.touch_queued(conn, ids)
        assert_exact(conn)
        assert counters.leased_by_server(conn) == {"gpu-a": 4, "gpu-b": 3}

        # gpu-b hedges one of gpu-a's items and its copy wins; one hedge mark is taken back
        hedged = claims.mark_hedged(conn, [ids[0], ids[1]], owner="wb")
        assert len(hedged) == 2
        claims.unmark_hedged(conn, [ids[1]], owner="wb")
        assert_exact(conn)
        ledger_outcomes.record_outcomes(
            conn,
            [
                ledger_outcomes.Done(ids[0], result(7, latency_s=0.5), server="gpu-b"),
                ledger_outcomes.Done(ids[1], result(9, finish="length", latency_s=3600.0)),
                ledger_outcomes.Failed(ids[2], "HTTP 400: prompt too long"),
                ledger_outcomes.RetryLater(ids[3], "timeout"),
            ],
            owner="wa",
            lease_s=600,
        )
        # the losing copy of the hedge writes too: the first result stays
        ledger_outcomes.record_outcomes(
            conn,
            [ledger_outcomes.Done(ids[0], result(11), server="gpu-a")],
            owner="wa",
            lease_s=600,
        )
        assert_exact(conn)
        released = ledger_outcomes.record_outcomes(
            conn, [ledger_outcomes.Released(ids[3], "server paused")], owner="wa", lease_s=600
        )
        assert released == [ids[3]]
        assert sorted(ledger_outcomes.release_owner(conn, "wb")) == sorted(c.id for c in b)
        assert_exact(conn)

        # a dead worker's lease expires and reconcile re-queues it
        claims.claim_items(conn, [ids[3]], owner="dead", server="gpu-c", lease_s=600)
        conn.execute(
            update(common.items)
            .where(common.items.c.id == ids[3])
            .values(lease_expires_at=common.utcnow() - timedelta(seconds=5))
        )
        assert ledger_outcomes.requeue_expired(conn, run_id=run.id) == [ids[3]]
        assert_exact(conn)

        # the waiting turn starts once its previous turn is done, with a longer prompt
        ready = turns.ready_turns(conn, run_id=run.id)
        assert [t.prev.id for t in ready] == [ids[0]]
        assert turns.start_turn(conn, ready[0].id, [{"role": "user", "content": "x"}], [5] * 9)
        assert_exact(conn)
        counts = reads.run_counts(conn, run)
        assert (counts.done, counts.failed, counts.truncated, counts.output_tokens) == (2, 1, 1, 16)
        # ten prompts of 4 (the two results report 4 too) and the started turn's 9
        assert counts.prompt_tokens == 10 * 4 + 9

        # compaction moves arrays, not counted values
        compaction.mark_compacted(conn, "file:///shard-0.parquet", [(ids[0], 0), (ids[1], 1)])
        assert_exact(conn)

    # hedge and latency groups as /metrics reads them
    with db.connect() as conn:
        groups = counters.counted_groups(conn, run.id)
        assert groups[counters.GroupKey(run.id, "gpu-b", "done", "stop")] == counters.Tally(
            1, 4, 7, 1
        )
        assert groups[counters.GroupKey(run.id, "gpu-a", "done", "length")] == counters.Tally(
            1, 4, 9, 0
        )
        lat = counters.counted_latencies(conn, run.id)
        assert lat[counters.LatencyKey(run.id, "gpu-b", 0)].items == 1  # 0.5 s: the first bound
        assert lat[counters.LatencyKey(run.id, "gpu-a", 12)].items == 1  # 3600 s: the last bound
        histograms = {h.server: h for h in metrics_queries.latency_histograms(conn)}
        assert histograms["gpu-a"].cumulative[-1] == 1 and histograms["gpu-a"].cumulative[-2] == 0
        assert histograms["gpu-b"].cumulative[0] == 1 and histograms["gpu-b"].sum_s == 0.5

    # a whole chain fails; a run is deleted (its items and counters go with it)
    with db.begin() as conn:
        other = support_runs.make_run(conn, "c2")
        queue.insert_items(conn, other.id, new_items(other, 3, prefix="o"))
        chain = [queue.NewItem("w", 0, 1, None, [], turn_index=t, waiting=True) for t in (1, 2, 3)]
        queue.insert_items(conn, other.id, chain)
        assert turns.fail_waiting_chain(conn, other.id, "w", 0, 2, "turn 1 failed") == 2
        assert_exact(conn)
        conn.execute(delete(common.items).where(common.items.c.id == ids[9]))
        assert_exact(conn)
        conn.execute(delete(common.runs).where(common.runs.c.id == run.id))
        assert_exact(conn)
        assert counters.counted_groups(conn, run.id) == {}
        assert reads.run_counts(conn, other).total == 6


# --- concurrent writers on Postgres -----------------------------------------------------------


def test_concurrent_workers_keep_the_counters_exact(pg_engine: Engine) -> None:
    """Six worker threads claim, hedge-duplicate, fail, retry and release the same run's items
    on their own connections while a seventh folds the shards; then counters == full count."""
    with pg_engine.begin() as conn:
        run = support_runs.make_run(conn, "busy")
        queue.insert_items(conn, run.id, new_items(run, 600))
        queue.mark_queued(conn, queue.pending_ids(conn, run.id))
    errors: list[BaseException] = []
    stop = threading.Event()
    released_once: set[int] = set()
    lock = threading.Lock()

    def first_release(item_id: int) -> bool:
        with lock:
            first = item_id not in released_once
            released_once.add(item_id)
            return first

    def worker(n: int) -> None:
        server, owner = f"gpu-{n % 3}", f"w{n}"
        try:
            while True:
                with pg_engine.begin() as conn:
                    claimed = claims.claim_next(
                        conn, owner=owner, server=server, lease_s=600, limit=8
                    )
                if not claimed:
                    return
                outcomes: list[ledger_outcomes.Outcome] = []
                for c in claimed:
                    kind = c.id % 5
                    if kind == 0:
                        outcomes.append(ledger_outcomes.Failed(c.id, "HTTP 400"))
                    elif kind == 1 and first_release(c.id):
                        outcomes.append(ledger_outcomes.Released(c.id, "paused"))
                    elif kind == 2 and c.attempts == 0:
                        outcomes.append(ledger_outcomes.RetryLater(c.id, "timeout"))
                        outcomes.append(ledger_outcomes.Released(c.id, "paused"))
                    else:
                        latency = 0.1 * (c.id % 40)
                        outcomes.append(
                            ledger_outcomes.Done(c.id, result(1 + c.id % 13, latency_s=latency))
                        )
                with pg_engine.begin() as conn:
                    ledger_outcomes.record_outcomes(conn, outcomes, owner=owner, lease_s=600)
                # a hedged duplicate from another server arrives late: it must not count
                done = [o for o in outcomes if isinstance(o, ledger_outcomes.Done)]
                with pg_engine.begin() as conn:
                    ledger_outcomes.record_outcomes(
                        conn,
                        [ledger_outcomes.Done(o.item_id, result(50), server="gpu-x") for o in done],
                        owner=owner,
                        lease_s=600,
                    )
        except BaseException as exc:
            errors.append(exc)

    def folder() -> None:
        try:
            while not stop.is_set():
                with pg_engine.begin() as conn:
                    counters.fold_shards(conn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    fold = threading.Thread(target=folder)
    fold.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    fold.join()
    assert errors == []
    with pg_engine.connect() as conn:
        assert_exact(conn)
        counts = reads.run_counts(conn, run)
        assert counts.total == 600 and counts.finished
        assert counts.failed == 120  # every id ≡ 0 (mod 5)
        assert counts.done == 480
        assert counters.leased_by_server(conn) == {}
        assert "gpu-x" not in {k.server for k in counters.counted_groups(conn)}


def test_writers_use_their_own_shards_and_a_fold_sums_them(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        run = support_runs.make_run(conn, "shards")
    for batch in range(3):  # three connections held at once: three backends
        conns = [pg_engine.connect() for _ in range(3)]
        try:
            for i, conn in enumerate(conns):
                with conn.begin():
                    queue.insert_items(conn, run.id, new_items(run, 5, prefix=f"b{batch}c{i}-"))
        finally:
            for conn in conns:
                conn.close()
    with pg_engine.begin() as conn:
        shards = conn.execute(
            select(func.count(func.distinct(counters.item_counts.c.shard)))
        ).scalar_one()
        assert shards >= 3
        assert counters.fold_shards(conn)
        rows = conn.execute(select(counters.item_counts)).all()
        assert [(r.shard, r.status, r.item_count) for r in rows] == [(0, "pending", 45)]
        assert_exact(conn)


def test_truncating_items_empties_the_counters(pg_engine: Engine) -> None:
    with pg_engine.begin() as conn:
        run = support_runs.make_run(conn, "t")
        queue.insert_items(conn, run.id, new_items(run, 4))
        conn.execute(text("TRUNCATE items CASCADE"))
        assert counters.counted_groups(conn) == {}
        assert_exact(conn)


# --- the migration backfills ------------------------------------------------------------------


@pytest.fixture
def fresh_pg() -> Iterator[Engine]:
    name = f"tokenmill_counters_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = database.make_engine(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}")
    yield engine
    engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_migration_backfills_existing_items(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    engine = (
        database.make_engine(f"sqlite:///{tmp_path / 'old.sqlite3'}")
        if backend == "sqlite"
        else request.getfixturevalue("fresh_pg")
    )
    migrate.upgrade(engine, "0005f")  # the revision before the counters
    with engine.begin() as conn:
        # the columns that revision has (today's models also read later ones)
        run_id = conn.execute(
            insert(common.runs)
            .values(
                name="old", tokenizer_path="/t", tokenizer_hash="a" * 64,
                chat_template_hash="b" * 64, chat_template_kwargs={},
                sampling_params=SamplingParams().to_json(), samples_per_prompt=1,
                eos_token_ids=[2], created_at=common.utcnow(),
            )
            .returning(common.runs.c.id)
        ).scalar_one()  # fmt: skip
        for i, status in enumerate(["pending", "queued", "leased", "done", "done", "failed"]):
            support_runs.add_item(
                conn,
                run_id,
                f"k{i}",
                status=status,
                completion_tokens=10 * i,
                latency_s=1.5 * i,
                finish_reason="length" if i == 4 else None,
            )
    migrate.upgrade(engine)
    with engine.connect() as conn:
        assert_exact(conn)
        run = run_queries.get_run(conn, "old")
        counts = reads.run_counts(conn, run)
        assert (counts.total, counts.done, counts.truncated, counts.output_tokens) == (6, 2, 1, 70)
    # and the downgrade removes the triggers with the tables
    config = migrate.alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0005f")
    with engine.begin() as conn:
        support_runs.add_item(conn, run.id, "after", status="pending")
    engine.dispose()


# --- verify --counts --------------------------------------------------------------------------


def test_verify_counts_finds_injected_drift_and_repairs_it(
    pg_engine: Engine, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pg_engine.begin() as conn:
        run = support_runs.make_run(conn, "v")
        support_runs.add_item(conn, run.id, "a", completion_tokens=5, latency_s=1.0)
        support_runs.add_item(conn, run.id, "b", status="leased")
        other = support_runs.make_run(conn, "w")
        support_runs.add_item(conn, other.id, "c", status="pending")
    for name, value in clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url).items():
        if name.startswith("TOKENMILL_"):
            monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        clean = CliRunner().invoke(cli, ["verify", "--counts"])
        assert clean.exit_code == 0, clean.output
        assert "equal to a full count" in clean.stdout

        # drift: a lost decrement in one key, a latency bucket off by one, an orphan key
        c = counters.item_counts.c
        with pg_engine.begin() as conn:
            conn.execute(
                update(counters.item_counts)
                .where(c.run_id == run.id, c.status == "leased")
                .values(item_count=c.item_count + 1)
            )
            conn.execute(
                update(counters.latency_counts)
                .where(counters.latency_counts.c.run_id == run.id)
                .values(item_count=counters.latency_counts.c.item_count + 1)
            )
            conn.execute(
                counters.item_counts.insert().values(
                    run_id=other.id,
                    server="gpu-z",
                    status="done",
                    finish_reason="stop",
                    shard=7,
                    item_count=1,
                    prompt_tokens=0,
                    completion_tokens=0,
                    hedged=0,
                )
            )
        dirty = CliRunner().invoke(cli, ["verify", "--counts", "--json"])
        assert dirty.exit_code == 1, dirty.output
        drift = json.loads(dirty.stdout)["drift"]
        assert len(drift) == 3
        assert any("status leased" in d for d in drift)
        # scoped to the other run: only its orphan key
        scoped = CliRunner().invoke(cli, ["verify", "--counts", "w"])
        assert scoped.exit_code == 1
        assert "server gpu-z" in scoped.stdout and "status leased" not in scoped.stdout
        with pg_engine.connect() as conn:
            assert reads.run_counts(conn, run).leased == 2  # what status would show

        repaired = CliRunner().invoke(cli, ["verify", "--counts", "--repair"])
        assert repaired.exit_code == 0, repaired.output
        assert "replaced by a full count" in repaired.stdout
        again = CliRunner().invoke(cli, ["verify", "--counts"])
        assert again.exit_code == 0, again.output
        with pg_engine.connect() as conn:
            assert reads.run_counts(conn, run).leased == 1

        usage = CliRunner().invoke(cli, ["verify", "--repair", "v"])
        assert usage.exit_code == 2
    finally:
        get_settings.cache_clear()


def test_repair_on_sqlite(sqlite_engine: Engine) -> None:
    with sqlite_engine.begin() as conn:
        run = support_runs.make_run(conn, "s")
        support_runs.add_item(conn, run.id, "a", completion_tokens=3, latency_s=0.2)
        conn.execute(update(counters.item_counts).values(completion_tokens=99))
        assert len(counters.find_drift(conn)) == 1
    assert len(counters.check(sqlite_engine, run.id, repair_drift=True)) == 1
    assert counters.check(sqlite_engine) == []


def test_a_batch_of_results_is_one_write_and_the_first_result_of_an_item_wins(db: Engine) -> None:
    with db.begin() as conn:
        run = support_runs.make_run(conn, "batch")
        queue.insert_items(conn, run.id, new_items(run, 3))
        ids = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, ids, owner="w", server="gpu-a", lease_s=600)
        ledger_outcomes.record_outcomes(
            conn,
            [
                ledger_outcomes.Done(ids[0], result(5, latency_s=1.0)),
                ledger_outcomes.Done(ids[1], result(6, finish="length")),
                ledger_outcomes.Done(
                    ids[0], result(9), server="gpu-b"
                ),  # a late copy in the same batch
            ],
            owner="w",
            lease_s=600,
        )
        rows = {
            r.id: r
            for r in conn.execute(
                select(
                    common.items.c.id,
                    common.items.c.completion_tokens,
                    common.items.c.server,
                    common.items.c.status,
                )
            )
        }
        assert (rows[ids[0]].completion_tokens, rows[ids[0]].server) == (5, "gpu-a")
        assert (rows[ids[1]].completion_tokens, rows[ids[1]].status) == (6, "done")
        assert rows[ids[2]].status == "leased"
        assert_exact(conn)
        assert reads.run_counts(conn, run).output_tokens == 11


def test_the_triggers_bucket_latencies_by_the_bounds_the_readers_use() -> None:
    migration = importlib.import_module("migrations.versions.0005e_counters")
    assert migration.LATENCY_BOUNDS_S == counters.LATENCY_BUCKETS_S
