"""Reconcile: the ledger says what is unfinished; put back what no worker holds.

Expired leases (dead workers) and never-published items are re-queued; running it twice
changes nothing because the messages it sends are idempotent claims.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine

from app.core.constants import EVENT_RECONCILED
from app.core.settings import Settings
from app.ledger import common, counters, database, event_log, outcomes, queue, run_queries
from workers.control.broker_scan import broker_holds

log = logging.getLogger(__name__)

# per pass: how many long-queued items are looked for in the broker, in how many messages
CHECK_ITEMS = 10_000
BROKER_MESSAGES = 20_000
# a pass that re-queued at least this many items is followed by ANALYZE items
ANALYZE_AFTER_ITEMS = 50_000


@dataclass
class ReconcileReport:
    expired: int = 0
    unpublished: int = 0
    lost: int = 0
    broker_checked: bool = False
    # later turns started (or failed) whose previous turn finished unnoticed (a killed worker)
    turns_started: int = 0
    turns_failed: int = 0

    @property
    def requeued(self) -> int:
        return self.expired + self.unpublished + self.lost

    def to_json(self) -> dict[str, Any]:
        return {
            "expired": self.expired,
            "unpublished": self.unpublished,
            "lost": self.lost,
            "broker_checked": self.broker_checked,
            "turns_started": self.turns_started,
            "turns_failed": self.turns_failed,
        }


def reconcile(
    db: Engine,
    settings: Settings,
    *,
    run: str | None,
    publish: Callable[[list[int], float], None],
) -> ReconcileReport:
    report = ReconcileReport()
    fold_counters(db)
    with db.connect() as conn:
        run_infos = [run_queries.get_run(conn, run)] if run else run_queries.list_runs(conn)
    run_id = run_infos[0].id if run else None
    # runs `tokenmill run` drives are left alone: their process takes its items from the ledger
    skip = [r.id for r in run_infos if not r.fleet_run]
    if run and skip:
        log.info(
            "reconcile: run %s is driven by `tokenmill run`; left alone",
            run,
            extra={"action": "run_skipped"},
        )
        return report
    with db.begin() as conn:
        database.limit_periodic(conn, timeout_s=database.SCAN_TIMEOUT_S)
        expired = outcomes.requeue_expired(conn, run_id=run_id, skip_runs=skip)
        publish(expired, 0.0)
    report.expired = len(expired)
    for info in run_infos:
        if not info.fleet_run:
            continue
        if info.generation.turns.chains:  # started turns are pending: the loop below publishes them
            # imported here: it brings the templating and the render client, which a
            # reconcile of runs without later turns never needs (tokenmill reconcile starts
            # faster)
            from workers.chains.advance import advance
            from workers.chains.tokenizers import shared_cache

            advanced = advance(db, shared_cache(), run_id=info.id)
            report.turns_started += len(advanced.started)
            report.turns_failed += advanced.failed
        after = 0
        while True:
            with db.connect() as conn:
                database.limit_periodic(conn, timeout_s=database.SCAN_TIMEOUT_S)
                ids = queue.pending_ids(conn, info.id, after_id=after)
            if not ids:
                break
            publish(ids, 0.0)
            with db.begin() as conn:
                queue.mark_queued(conn, ids)
            report.unpublished += len(ids)
            after = ids[-1]
    report.lost = _requeue_lost(db, settings, run_id, publish, report, skip)
    if report.requeued >= ANALYZE_AFTER_ITEMS:
        with db.begin() as conn:
            queue.refresh_statistics(conn)
    if report.requeued:
        log.info(
            "reconcile re-queued %d expired, %d unpublished and %d lost items",
            report.expired,
            report.unpublished,
            report.lost,
            extra={"action": "requeued"},
        )
        with db.begin() as conn:
            event_log.record_event(
                conn,
                EVENT_RECONCILED,
                f"reconcile re-queued {report.expired} "
                f"expired, {report.unpublished} unpublished and {report.lost} "
                "items the broker had lost",
                run_id=run_id,
                details=report.to_json(),
            )
    return report


def fold_counters(db: Engine) -> None:
    """Sum the item counters' per-writer shards, so views keep reading a few rows per key."""
    with db.begin() as conn:
        if not counters.fold_shards(conn):
            log.debug("item counters: another fold is running")


def _requeue_lost(
    db: Engine,
    settings: Settings,
    run_id: int | None,
    publish: Callable[[list[int], float], None],
    report: ReconcileReport,
    skip_runs: list[int],
) -> int:
    """Items queued in the ledger for a while that no broker message carries any more.

    Bounded per pass, whatever the size of the queue: the CHECK_ITEMS longest-queued items
    are looked for in at most BROKER_MESSAGES messages, read from the end workers consume
    from. An item is judged lost only when the whole queue was read (a long queue is judged
    once it drains that far); re-sent items go to the back of the order (queued_at = now),
    so the next pass checks the next ones."""
    cutoff = common.utcnow() - timedelta(seconds=settings.reconcile_grace_s)
    with db.connect() as conn:
        database.limit_periodic(conn, timeout_s=database.SCAN_TIMEOUT_S)
        candidates = queue.oldest_queued(
            conn, cutoff, limit=CHECK_ITEMS, run_id=run_id, skip_runs=skip_runs
        )
    check = broker_holds(
        settings.resolved_broker_url(),
        candidates,
        unacked_grace_s=settings.reconcile_grace_s,
        max_messages=BROKER_MESSAGES,
    )
    if check is None:
        return 0
    report.broker_checked = True
    if not check.complete:
        log.info(
            "reconcile: the broker holds more than %d messages; lost items are looked for "
            "once it drains",
            BROKER_MESSAGES,
            extra={"action": "lost_scan_deferred"},
        )
        return 0
    lost = [i for i in candidates if i not in check.found]
    if lost:
        with db.begin() as conn:
            queue.touch_queued(conn, lost)
        publish(lost, 0.0)
    return len(lost)
