"""The generate pipeline behind the Celery task: claim the message's items, hand them to the
window, or put the message back when this worker's server cannot take work right now.

Plain functions, testable without Celery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from app import ledger
from app.ledger import Released
from workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

Requeue = Callable[[list[int], float], None]


def handle_message(
    rt: WorkerRuntime, item_ids: Sequence[int], *, requeue: Requeue
) -> dict[str, int]:
    """Claim and submit item_ids; return counts for the task's result and Flower."""
    ids = [int(i) for i in item_ids]
    wait_s = rt.settings.unavailable_wait_s
    if rt.window.unavailable() or rt.paused():
        requeue(ids, wait_s)
        return {"claimed": 0, "skipped": 0, "deferred": len(ids)}
    # backpressure: take the message only when the window can hold its items
    if not rt.window.wait_for_room(len(ids)):
        requeue(ids, 0.0)
        return {"claimed": 0, "skipped": 0, "deferred": len(ids)}
    with rt.db.begin() as conn:
        claimed = ledger.claim_items(
            conn, ids, owner=rt.owner, server=rt.server_name, lease_s=rt.settings.lease_s
        )
    refused = [c for c in claimed if not rt.run_matches_server(c.run_id)]
    if refused:
        with rt.db.begin() as conn:
            back = ledger.record_outcomes(
                conn,
                [Released(c.id, "server fingerprint differs from the run's") for c in refused],
                owner=rt.owner,
                lease_s=rt.settings.lease_s,
            )
        requeue(back, wait_s)
    accepted = [c for c in claimed if c not in refused]
    rt.window.submit(accepted)
    skipped = len(ids) - len(claimed)
    if skipped:
        log.info("message of %d items: %d already taken or finished", len(ids), skipped)
    return {"claimed": len(accepted), "skipped": skipped, "deferred": len(refused)}
