"""Postgres query plans of the hot and periodic paths, and the heartbeat/writer interleaving.

Each ledger function runs against a synthetic ledger (the end of one run while another is
still queued), its statements are captured as sent, and their EXPLAIN must read items
through the expected index: never a sequential scan, and keyset pages never sort. The
statistics are left as they were after the enqueue (everything pending) or refreshed: the
plans must be the same either way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, insert, select, text

from app.core import contracts
from app.core.failures import NO_REASON
from app.ledger import (
    archive,
    claims,
    common,
    compaction,
    dashboard_queries,
    outcomes,
    queue,
    reads,
    registry,
    retries,
)
from tests.support import synthetic
from tests.support.procs import wait_for
from tests.support.runs import make_run

ENDING_ITEMS = 20_000
QUEUED_ITEMS = 10_000


@pytest.fixture(params=["stale", "fresh"])
def filled(request: pytest.FixtureRequest, pg_engine: Engine) -> Iterator[synthetic.Ledger]:
    """The synthetic ledger, committed, with autovacuum off so the stale statistics stay."""
    with pg_engine.begin() as conn:
        conn.execute(text("ALTER TABLE items SET (autovacuum_enabled = off)"))
    try:
        with pg_engine.begin() as conn:
            filled = synthetic.fill(
                conn,
                ending_items=ENDING_ITEMS,
                queued_items=QUEUED_ITEMS,
                stale=request.param == "stale",
            )
        yield filled
    finally:
        with pg_engine.begin() as conn:
            conn.execute(text("ALTER TABLE items RESET (autovacuum_enabled)"))


@contextmanager
def captured(conn: Connection) -> Iterator[list[tuple[str, Any]]]:
    seen: list[tuple[str, Any]] = []

    def hook(*args: Any) -> None:
        _conn, _cursor, statement, parameters, _context, executemany = args
        if not executemany and "set_config" not in statement:
            seen.append((statement, parameters))

    event.listen(conn, "before_cursor_execute", hook)
    try:
        yield seen
    finally:
        event.remove(conn, "before_cursor_execute", hook)


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def plans_of(conn: Connection, call: Callable[[Connection], object]) -> list[list[dict[str, Any]]]:
    """The plan nodes of every statement call sends on conn."""
    with captured(conn) as seen:
        call(conn)
    assert seen, "the call sent no statement"
    out = []
    for statement, parameters in seen:
        explained = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement, parameters)
        out.append(list(nodes(explained.scalar_one()[0]["Plan"])))
    return out


def indexes_used(plans: list[list[dict[str, Any]]]) -> set[str]:
    return {n["Index Name"] for plan in plans for n in plan if "Index Name" in n}


def assert_indexed(plans: list[list[dict[str, Any]]], *expected: str, sorts: bool = True) -> None:
    for plan in plans:
        scans = [
            n
            for n in plan
            if n["Node Type"] == "Seq Scan" and n["Relation Name"] in ("items", "items_archive")
        ]
        assert scans == [], f"sequential scan in {plan}"
        walks = [n for n in plan if n.get("Index Name") == "items_pkey" and "Index Cond" not in n]
        assert walks == [], f"a walk of the whole primary key in {plan}"
        if not sorts:
            assert [n for n in plan if n["Node Type"] in ("Sort", "Incremental Sort")] == []
    used = indexes_used(plans)
    assert set(expected) <= used, f"expected {expected}, used {used}"


def test_hedge_search_reads_leases_and_probes_runs(pg_engine: Engine, filled: Any) -> None:
    with pg_engine.connect() as conn:
        found = claims.hedge_candidates(conn, server="gpu-c", limit=8)
        assert len(found) == 8 and {run for _, run in found} == {filled.ending.id}
        plans = plans_of(conn, lambda c: claims.hedge_candidates(c, server="gpu-c", limit=8))
        # "anything left to claim?" is read from the run's item counters
        assert_indexed(plans, "item_counts_pkey")
        assert indexes_used(plans) & {"ix_items_leased_started", "ix_items_status_lease"}
        assert claims.claimable_left(conn, filled.queued.id)
        assert not claims.claimable_left(conn, filled.ending.id)


def test_worker_and_watchdog_lookups(pg_engine: Engine, filled: Any) -> None:
    with pg_engine.connect() as conn:
        some = list(
            conn.execute(select(common.items.c.id).limit(50).order_by(common.items.c.id)).scalars()
        )
        assert_indexed(plans_of(conn, lambda c: claims.finished_among(c, some)), "items_pkey")
        load = registry.server_load(conn, "gpu-a")
        assert load.leased == filled.leased // 2 and load.last_finished_at is not None
        watchdog = plans_of(conn, lambda c: registry.server_load(c, "gpu-a"))
        assert_indexed(watchdog)
        assert indexes_used(watchdog) & {"ix_items_done_finished", "ix_items_server_finished"}
        assert_indexed(
            plans_of(conn, lambda c: claims.extend_leases(c, owner="worker-a", lease_s=60)),
        )
        assert_indexed(plans_of(conn, registry.active_run_fingerprints))
        assert_indexed(
            plans_of(conn, lambda c: outcomes.requeue_expired(c)), "ix_items_status_lease"
        )


def test_keyset_pages_read_one_index_range_in_order(pg_engine: Engine, filled: Any) -> None:
    run = filled.ending.id
    with pg_engine.connect() as conn:

        def stats(c: Connection) -> None:
            pages = dashboard_queries.iter_item_stats(c, run, page_size=1000)
            for _ in range(3000):  # well into the run
                next(pages)

        assert_indexed(plans_of(conn, stats), "ix_items_run_status_id", sorts=False)
        failed = plans_of(
            conn, lambda c: list(reads.iter_items(c, run, statuses=("failed",), page_size=100))
        )
        assert_indexed(failed, "ix_items_run_status_id", sorts=False)
        assert_indexed(
            plans_of(conn, lambda c: queue.pending_ids(c, filled.queued.id)),
            "ix_items_run_status_id",
            sorts=False,
        )


def test_the_embedded_runners_claims_read_what_they_take(pg_engine: Engine, filled: Any) -> None:
    """The ending run's rows are mostly done: a claim reads the (run_id, status, id) ranges
    of its claimable statuses, never the primary key past the done rows."""
    run = filled.ending.id
    for claim in (claims.claim_next, claims.claim_next_groups):
        with pg_engine.connect() as conn:
            plans = plans_of(
                conn,
                lambda c, claim=claim: claim(
                    c, owner="runner", server="gpu-a", lease_s=60, limit=32, run_id=run
                ),
            )
            conn.rollback()
        assert_indexed(plans, "ix_items_run_status_id", sorts=False)


def test_compaction_and_reconcile_scans(pg_engine: Engine, filled: Any) -> None:
    run = filled.ending.id
    with pg_engine.connect() as conn:
        assert compaction.count_compactable(conn, run) == synthetic.UNCOMPACTED
        assert compaction.count_uncompacted(conn, run, at_most=10) == 10
        assert compaction.count_uncompacted(conn, run, at_most=10**6) == synthetic.UNCOMPACTED
        for call in (
            lambda c: compaction.count_compactable(c, run),
            lambda c: compaction.count_uncompacted(c, run, at_most=10),
            lambda c: compaction.compactable_ids(c, run, after_id=0, limit=100),
            lambda c: compaction.runs_with_compactable(c, 10),
        ):
            assert_indexed(plans_of(conn, call), "ix_items_uncompacted")
        cutoff = common.utcnow()
        oldest = queue.oldest_queued(conn, cutoff, limit=100)
        assert len(oldest) == 100
        assert_indexed(
            plans_of(conn, lambda c: queue.oldest_queued(c, cutoff, limit=100)),
            "ix_items_queued_at",
            sorts=False,
        )
        assert_indexed(plans_of(conn, lambda c: archive.archive_blockers(c, run)))


def test_failures_by_reason_and_touched_items_are_read_by_their_own_index(
    pg_engine: Engine, filled: Any
) -> None:
    """`status` counts a run's failures by reason in the hot table and the archive: each an
    ordered range of its partial index of failed rows, no sort; reconcile's touch of the items
    it re-sent reads their primary keys, in statements of queue.TOUCH_ROWS."""
    run = filled.ending.id
    with pg_engine.connect() as conn:
        # the run's failed rows archived too (under other ids): an archive to count
        names = [c.name for c in common.items.columns]
        copied = [
            (common.items.c.id + 10**9).label("id") if n == "id" else common.items.c[n]
            for n in names
        ]
        failed = select(*copied).where(
            common.items.c.run_id == run, common.items.c.status == "failed"
        )
        conn.execute(insert(common.items_archive).from_select(names, failed))
        assert retries.failed_by_reason(conn, run) == [(NO_REASON, 2 * (ENDING_ITEMS // 100))]
        plans = plans_of(conn, lambda c: retries.failed_by_reason(c, run))
        assert_indexed(
            plans, "ix_items_failed_reason", "ix_items_archive_failed_reason", sorts=False
        )

        touched_at = common.utcnow()
        queued = queue.oldest_queued(conn, touched_at, limit=queue.TOUCH_ROWS + 100)
        touches = plans_of(conn, lambda c: queue.touch_queued(c, queued))
        assert len(touches) == 2
        assert_indexed(touches, "items_pkey")
        # every one of them is queued from now on, the first statement's and the second's
        assert set(queued).isdisjoint(queue.oldest_queued(conn, touched_at, limit=10**5))
        conn.rollback()


def test_a_heartbeat_skips_rows_a_result_write_holds(pg_engine: Engine) -> None:
    """The interleaving that deadlocked: the writer holds B and goes on to A while the
    heartbeat renews the owner's leases. The heartbeat must neither wait for B (it skips
    it) nor keep the writer from finishing once it commits."""
    with pg_engine.begin() as conn:
        run = make_run(conn, "beat")
        new = [queue.NewItem(f"k{i}", 0, i, None, [1, 2, 3]) for i in range(2)]
        queue.insert_items(conn, run.id, new)
        a, b = queue.pending_ids(conn, run.id)
        # leases past half their term: the heartbeat below renews them
        claims.claim_items(conn, [a, b], owner="w", server="s", lease_s=20)
    result = contracts.GenerateResult("r", [5, 6], "stop", 6, 3, 2, 0, 0.1)
    writer = pg_engine.connect()
    heartbeat = pg_engine.connect()
    errors: list[BaseException] = []
    try:
        writer.begin()
        outcomes.record_outcomes(writer, [outcomes.Done(b, result)], owner="w", lease_s=60)
        writer_pid = writer.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
        heartbeat.begin()
        # the old heartbeat waited here for B while holding A; fail instead of hanging
        heartbeat.exec_driver_sql("SET LOCAL lock_timeout = '20s'")
        assert claims.extend_leases(heartbeat, owner="w", lease_s=60) == 1

        def write_a() -> None:
            try:
                outcomes.record_outcomes(writer, [outcomes.Done(a, result)], owner="w", lease_s=60)
                writer.commit()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=write_a)
        thread.start()
        with pg_engine.connect() as watch:
            wait_for(
                "the writer to wait for the heartbeat's lock on A",
                lambda: (
                    watch.execute(
                        text("SELECT count(*) FROM pg_locks WHERE pid = :p AND NOT granted"),
                        {"p": writer_pid},
                    ).scalar_one()
                    > 0
                ),
                timeout_s=30,
            )
        heartbeat.commit()
        thread.join(timeout=60)
        assert not thread.is_alive() and errors == []
    finally:
        writer.close()
        heartbeat.close()
    with pg_engine.connect() as conn:
        statuses = conn.execute(
            select(common.items.c.status)
            .where(common.items.c.id.in_([a, b]))
            .order_by(common.items.c.id)
        ).scalars()
        assert list(statuses) == ["done", "done"]
