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


def _release(rt: WorkerRuntime, claimed: Sequence[ledger.ClaimedItem], reason: str) -> list[int]:
    """Give claimed items back to the queue without spending an attempt."""
    if not claimed:
        return []
    with rt.db.begin() as conn:
        return ledger.record_outcomes(
            conn,
            [Released(c.id, reason) for c in claimed],
            owner=rt.owner,
            lease_s=rt.settings.lease_s,
        )


def handle_message(
    rt: WorkerRuntime, item_ids: Sequence[int], *, requeue: Requeue
) -> dict[str, int | str]:
    """Claim and submit item_ids; return counts and this worker's server for the task's
    result (Flower shows it)."""
    ids = [int(i) for i in item_ids]
    wait_s = rt.settings.unavailable_wait_s
    if rt.window.unavailable() or rt.paused():
        requeue(ids, wait_s)
        return {"claimed": 0, "skipped": 0, "deferred": len(ids), "server": rt.server_name}
    # claim before waiting: while this task waits for room its items are leased in the ledger
    # (and come back by lease expiry if the worker dies), not hidden in an unacked message
    with rt.db.begin() as conn:
        claimed = ledger.claim_items(
            conn, ids, owner=rt.owner, server=rt.server_name, lease_s=rt.settings.lease_s
        )
    # backpressure: hold the message until the window can take its items
    room = rt.window.wait_for_room(len(claimed)) if claimed else True
    if not room or rt.window.unavailable() or rt.paused():
        back = _release(rt, claimed, "server paused or worker stopping while waiting")
        requeue(back, 0.0 if not room else wait_s)
        return {
            "claimed": 0,
            "skipped": len(ids) - len(claimed),
            "deferred": len(back),
            "server": rt.server_name,
        }
    refused = [c for c in claimed if not rt.run_matches_server(c.run_id)]
    if refused:
        requeue(_release(rt, refused, "server fingerprint differs from the run's"), wait_s)
    accepted = [c for c in claimed if c not in refused]
    rt.window.submit(accepted)
    skipped = len(ids) - len(claimed)
    if skipped:
        log.info("message of %d items: %d already taken or finished", len(ids), skipped)
    return {
        "claimed": len(accepted),
        "skipped": skipped,
        "deferred": len(refused),
        "server": rt.server_name,
    }
