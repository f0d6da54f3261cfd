"""Publishing generate messages: item ids only, a batch per message, never token arrays.

A message is disposable: publishing one twice, or losing one, is harmless to the ledger.

Each message carries its run's priority as the broker's message priority, so the broker hands
out an urgent run's messages first. kombu's Redis transport keeps one list per priority step
(`generate`, then `generate\x06\x16<step>`; app.celery_app names the steps) and serves step 0
first, the opposite of a run's priority (higher first): broker_priority maps one onto the other.
The broker's order is coarse (ten steps) and covers only what is still in Redis; the worker's
claim order (workers/engine/scheduling.py) is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import Engine

from app.celery_app import celery_app
from app.core.constants import BROKER_PRIORITY_STEPS, GENERATE_TASK, WORK_QUEUE
from app.ledger import run_queries

# the step of a run of priority 0: runs above it come earlier steps, below it later ones
DEFAULT_STEP = 5

log = logging.getLogger(__name__)


def chunks(ids: Sequence[int], size: int) -> list[list[int]]:
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


def describe(chunk: Sequence[int], run: str | None = None) -> str:
    """What Flower and the worker log show for a message's args: its run (when the sender
    knows it) and its id range, e.g. `run=r1 [4 items: 10..13]`."""
    ids = f"[{len(chunk)} items: {chunk[0]}..{chunk[-1]}]"
    return f"run={run} {ids}" if run else ids


def broker_priority(run_priority: int) -> int:
    """The broker's message priority (0 served first) carrying a run's priority (higher first):
    priority 0 at DEFAULT_STEP, each point above or below it one step, clamped to the steps."""
    first, last = BROKER_PRIORITY_STEPS[0], BROKER_PRIORITY_STEPS[-1]
    return max(first, min(last, DEFAULT_STEP - run_priority))


def publish_items(
    ids: Sequence[int],
    *,
    batch_size: int,
    countdown_s: float = 0.0,
    run: str | None = None,
    priority: int = 0,
) -> int:
    """Send ids as generate messages of at most batch_size ids; return messages sent.

    run, when the caller knows it, only labels the messages (argsrepr); the task reads ids.
    priority: the run's (all ids of one run, or of runs of that priority)."""
    sent = 0
    with celery_app.producer_or_acquire() as producer:
        for chunk in chunks(ids, batch_size):
            celery_app.send_task(
                GENERATE_TASK,
                args=[chunk],
                queue=WORK_QUEUE,
                countdown=countdown_s or None,
                argsrepr=describe(chunk, run),
                priority=broker_priority(priority),
                producer=producer,
            )
            sent += 1
    log.debug("published %d ids in %d messages", len(ids), sent)
    return sent


def publish_by_priority(
    db: Engine, ids: Sequence[int], *, batch_size: int, countdown_s: float = 0.0
) -> int:
    """publish_items for ids of any runs (a worker's requeue, reconcile): each run's priority,
    read from the ledger now, goes with its ids (ids the ledger no longer has: priority 0)."""
    if not ids:
        return 0
    with db.connect() as conn:
        ranks = run_queries.item_priorities(conn, ids)
    by_priority: dict[int, list[int]] = {}
    for item_id in ids:
        by_priority.setdefault(ranks.get(item_id, 0), []).append(item_id)
    sent = 0
    for priority in sorted(by_priority, reverse=True):  # the urgent ones first
        sent += publish_items(
            by_priority[priority],
            batch_size=batch_size,
            countdown_s=countdown_s,
            priority=priority,
        )
    return sent
