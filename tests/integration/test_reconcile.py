"""Reconcile against real Redis and Postgres: expired leases and items whose messages Redis
lost come back; never-published items are published; running it twice changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from celery import Celery
from sqlalchemy import Engine, update

from app.celery_app import celery_config
from app.core.constants import GENERATE_TASK, WORK_QUEUE
from app.core.contracts import SamplingParams
from app.core.settings import Settings
from app.ledger import claims, common, queue, reads, run_queries
from workers.control.broker_scan import broker_holds, broker_item_ids
from workers.control.reconcile import reconcile
from workers.intake.publish import chunks


def publisher(settings: Settings) -> tuple[Callable[[list[int], float], None], list[int]]:
    app = Celery("reconcile-test")
    app.conf.update(celery_config(settings))
    sent: list[int] = []

    def publish(ids: list[int], countdown_s: float) -> None:
        for chunk in chunks(ids, 4):
            app.send_task(GENERATE_TASK, args=[chunk], queue=WORK_QUEUE)
        sent.extend(ids)

    return publish, sent


def test_reconcile_brings_back_lost_expired_and_unpublished(
    pg_url: str,
    pg_engine: Engine,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(
        data_dir=tmp_path, database_url=pg_url, broker_url=redis_url, reconcile_grace_s=30
    )
    publish, sent = publisher(settings)
    spec = run_queries.RunSpec("r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2])
    with pg_engine.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"k{i}", 0, i, None, [1, i]) for i in range(30)]
        )
        ids = queue.pending_ids(conn, run.id)
    # 10 published and then lost with Redis, 10 leased by a worker that died, 10 never sent
    publish(ids[:10], 0)
    with pg_engine.begin() as conn:
        queue.mark_queued(conn, ids[:20])
        claims.claim_items(conn, ids[10:20], owner="dead", server="s", lease_s=1)
        conn.execute(
            update(common.items)
            .where(common.items.c.id.in_(ids[:20]))
            .values(
                queued_at=common.utcnow() - timedelta(seconds=60),
                lease_expires_at=common.utcnow() - timedelta(seconds=5),
            )
        )
    assert broker_item_ids(redis_url) == set(ids[:10])
    redis.Redis.from_url(redis_url).flushdb()  # Redis restarted without persistence
    sent.clear()

    monkeypatch.setattr(queue, "TOUCH_ROWS", 3)  # the 10 lost items touched in 4 statements
    first = reconcile(pg_engine, settings, run=None, publish=publish)
    assert first.to_json() == {
        "expired": 10,
        "unpublished": 10,
        "lost": 10,
        "broker_checked": True,
        "turns_started": 0,
        "turns_failed": 0,
    }
    assert sorted(sent) == ids
    assert broker_item_ids(redis_url) == set(ids)
    with pg_engine.connect() as conn:
        assert reads.run_counts(conn, run).queued == 30
        # every re-sent item's grace period starts again: none is queued from before it
        cutoff = common.utcnow() - timedelta(seconds=settings.reconcile_grace_s)
        assert queue.oldest_queued(conn, cutoff, limit=100, run_id=run.id) == []

    sent.clear()
    second = reconcile(pg_engine, settings, run="r", publish=publish)
    assert second.requeued == 0 and sent == []


def test_the_broker_check_is_bounded_and_reads_from_the_consuming_end(
    redis_url: str, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path, broker_url=redis_url)
    publish, _ = publisher(settings)
    publish(list(range(1, 401)), 0)  # 100 messages of 4 ids, 1..4 first (consumed first)
    url = settings.resolved_broker_url()
    whole = broker_holds(url, [2, 399, 5000], unacked_grace_s=30, max_messages=10_000)
    assert whole is not None and whole.complete and whole.found == {2, 399}
    # the oldest ids are found in the first messages read, and the read stops there
    first = broker_holds(url, [1, 2, 4], unacked_grace_s=30, max_messages=1)
    assert first is not None and first.complete and first.found == {1, 2, 4}
    # an id in no message is judged missing only after the whole queue was read
    capped = broker_holds(url, [1, 5000], unacked_grace_s=30, max_messages=1)
    assert capped is not None and not capped.complete and capped.found == {1}
    assert broker_holds("memory://", [1], unacked_grace_s=30, max_messages=10) is None


def test_reconcile_waits_for_a_long_queue_before_calling_items_lost(
    pg_url: str, pg_engine: Engine, redis_url: str, tmp_path: Path, monkeypatch: object
) -> None:
    import workers.control.reconcile as reconcile_module

    settings = Settings(
        data_dir=tmp_path, database_url=pg_url, broker_url=redis_url, reconcile_grace_s=30
    )
    publish, sent = publisher(settings)
    spec = run_queries.RunSpec("long", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, None, [2])
    with pg_engine.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"k{i}", 0, i, None, [1, i]) for i in range(40)]
        )
        ids = queue.pending_ids(conn, run.id)
        queue.mark_queued(conn, ids)
        conn.execute(
            update(common.items)
            .where(common.items.c.id.in_(ids))
            .values(queued_at=common.utcnow() - timedelta(seconds=60))
        )
    publish(ids[20:], 0)  # the first 20 were lost; 5 messages carry the other 20
    sent.clear()
    setattr(reconcile_module, "BROKER_MESSAGES", 2)  # noqa: B010 - restored below
    try:
        assert reconcile(pg_engine, settings, run="long", publish=publish).lost == 0
        assert sent == []
    finally:
        setattr(reconcile_module, "BROKER_MESSAGES", 20_000)  # noqa: B010
    assert reconcile(pg_engine, settings, run="long", publish=publish).lost == 20
    assert sorted(sent) == ids[:20]
