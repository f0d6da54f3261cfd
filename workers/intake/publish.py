"""Publishing generate messages: item ids only, a batch per message, never token arrays.

A message is disposable: publishing one twice, or losing one, is harmless to the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from app.celery_app import celery_app
from app.core.constants import GENERATE_TASK, WORK_QUEUE

log = logging.getLogger(__name__)


def chunks(ids: Sequence[int], size: int) -> list[list[int]]:
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


def describe(chunk: Sequence[int], run: str | None = None) -> str:
    """What Flower and the worker log show for a message's args: its run (when the sender
    knows it) and its id range, e.g. `run=r1 [4 items: 10..13]`."""
    ids = f"[{len(chunk)} items: {chunk[0]}..{chunk[-1]}]"
    return f"run={run} {ids}" if run else ids


def publish_items(
    ids: Sequence[int], *, batch_size: int, countdown_s: float = 0.0, run: str | None = None
) -> int:
    """Send ids as generate messages of at most batch_size ids; return messages sent.

    run, when the caller knows it, only labels the messages (argsrepr); the task reads ids."""
    sent = 0
    with celery_app.producer_or_acquire() as producer:
        for chunk in chunks(ids, batch_size):
            celery_app.send_task(
                GENERATE_TASK,
                args=[chunk],
                queue=WORK_QUEUE,
                countdown=countdown_s or None,
                argsrepr=describe(chunk, run),
                producer=producer,
            )
            sent += 1
    log.debug("published %d ids in %d messages", len(ids), sent)
    return sent
