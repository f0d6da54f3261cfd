"""A run's priority through the real CLI and services: `tokenmill priority` changes it (an
event), `status` shows it (text and --json); and after Redis loses every message, `tokenmill
reconcile` sends each run's items again with its run's priority, so kombu hands the urgent
run's messages out first."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, update

from app.celery_app import celery_config
from app.core.constants import WORK_QUEUE
from app.core.contracts import SamplingParams
from app.core.errors import RunMismatch
from app.core.settings import Settings
from app.ledger import claims, common, database, migrate, queue, run_queries
from tests.support.procs import clean_env, service_env, tokenmill
from tests.support.runs import make_run


def test_priority_changes_a_run_and_status_shows_it(tmp_path: Path) -> None:
    engine = database.make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    migrate.upgrade(engine)
    with engine.begin() as conn:
        make_run(conn, "big")
        make_run(conn, "eval")
    env = clean_env(tmp_path, COLUMNS="120")

    changed = tokenmill(["priority", "eval", "7"], env)
    assert changed.returncode == 0, changed.stderr
    assert "run eval: priority 0 → 7" in changed.stdout
    again = tokenmill(["priority", "eval", "7"], env)
    assert "run eval: priority 7 (unchanged)" in again.stdout

    shown = tokenmill(["status", "--json"], env)
    assert {r["run"]: r["priority"] for r in json.loads(shown.stdout)} == {"big": 0, "eval": 7}
    text = tokenmill(["status"], env).stdout
    assert "run eval: priority 7 (higher first)" in text and "run big: priority" not in text
    events = tokenmill(["events", "--run", "eval"], env).stdout
    assert "run eval: priority 0 → 7" in events

    missing = tokenmill(["priority", "nope", "1"], env)
    assert missing.returncode != 0 and "no run named 'nope'" in missing.stderr
    bad = tokenmill(["priority", "eval", "high"], env)
    assert bad.returncode == 2 and "'high' is not a valid integer" in bad.stderr


def queued_run(db: Engine, name: str, n: int, priority: int) -> list[int]:
    """A run of n items queued a minute ago (past reconcile's grace), none in the broker."""
    spec = run_queries.RunSpec(
        name, "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2], priority=priority
    )
    with db.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"{name}{i}", 0, i, None, [1, i]) for i in range(n)]
        )
        ids = queue.pending_ids(conn, run.id)
        queue.mark_queued(conn, ids)
        conn.execute(
            update(common.items)
            .where(common.items.c.id.in_(ids))
            .values(queued_at=common.utcnow() - timedelta(seconds=60))
        )
    return ids


def consumed_in_order(settings: Settings) -> list[int]:
    """Every item id in the work queue, in the order kombu hands the messages out."""
    app = Celery("priority-test")
    app.conf.update(celery_config(settings))
    out: list[int] = []
    with app.connection_for_read() as conn:
        simple = conn.SimpleQueue(WORK_QUEUE, no_ack=True)
        try:
            while True:
                try:
                    message = simple.get(block=False)
                except simple.Empty:
                    return out
                args = message.payload[0]  # Celery's message body: [args, kwargs, embed]
                out += [int(i) for i in args[0]]
        finally:
            simple.close()


def test_a_reconcile_after_a_broker_flush_keeps_the_order(
    pg_url: str, pg_engine: Engine, redis_url: str, tmp_path: Path
) -> None:
    big = queued_run(pg_engine, "big", 40, priority=0)
    urgent = queued_run(pg_engine, "urgent", 8, priority=10)
    later = queued_run(pg_engine, "later", 4, priority=-3)
    redis.Redis.from_url(redis_url).flushdb()  # Redis restarted without persistence

    env = service_env(pg_url, redis_url, tmp_path, TOKENMILL_RECONCILE_GRACE_S="30")
    done = tokenmill(["reconcile"], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lost"] == 52

    settings = Settings(data_dir=tmp_path, database_url=pg_url, broker_url=redis_url)
    order = consumed_in_order(settings)
    assert sorted(order) == sorted(big + urgent + later)
    # the urgent run's messages first, the big run's next, the lowered run's last
    assert set(order[:8]) == set(urgent)
    assert set(order[8:48]) == set(big)
    assert set(order[48:]) == set(later)


def test_a_run_pins_its_priority_and_a_later_enqueue_may_not_change_it(db: Engine) -> None:
    def spec(priority: int | None) -> run_queries.RunSpec:
        return run_queries.RunSpec(
            "eval", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2], priority=priority
        )

    with db.begin() as conn:
        created, new = run_queries.get_or_create_run(conn, spec(10))
        assert new and created.priority == 10
        # a later enqueue that names no priority, or the same one, joins the run
        assert run_queries.get_or_create_run(conn, spec(None)) == (created, False)
        assert run_queries.get_or_create_run(conn, spec(10))[0].priority == 10
        with pytest.raises(RunMismatch, match=r"priority: 10 → 3 \(`tokenmill priority eval 3`"):
            run_queries.get_or_create_run(conn, spec(3))
        assert run_queries.set_priority(conn, "eval", 3) == 10
        assert run_queries.get_or_create_run(conn, spec(3))[0].priority == 3
        default, _ = run_queries.get_or_create_run(
            conn,
            run_queries.RunSpec(
                "plain", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2]
            ),
        )
        assert default.priority == 0
        assert run_queries.run_priorities(conn) == {created.id: 3, default.id: 0}


def test_hedges_go_to_the_highest_priority_runs_end_first(db: Engine) -> None:
    with db.begin() as conn:
        ids = {}
        big = make_run(conn, "big")
        urgent = make_run(conn, "urgent")
        run_queries.set_priority(conn, "urgent", 10)
        for run in (big, urgent):
            queue.insert_items(
                conn,
                run.id,
                [queue.NewItem(f"{run.name}{i}", 0, i, None, [1, i]) for i in range(2)],
            )
            ids[run.name] = queue.pending_ids(conn, run.id)
            claims.claim_items(conn, ids[run.name], owner="a-worker", server="a", lease_s=600)
        # the big run's items have run longer: without priorities they would be hedged first
        old = common.utcnow() - timedelta(seconds=60)
        conn.execute(
            update(common.items).where(common.items.c.id.in_(ids["big"])).values(started_at=old)
        )
    with db.connect() as conn:
        found = claims.hedge_candidates(conn, server="b", limit=3)
    assert [run_id for _, run_id in found] == [urgent.id, urgent.id, big.id]
