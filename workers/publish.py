"""Publishing generate messages: item ids only, a batch per message, never token arrays.

A message is disposable: publishing one twice, or losing one, is harmless to the ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from app.celery_app import celery_app
from app.constants import GENERATE_TASK, WORK_QUEUE

log = logging.getLogger(__name__)


def chunks(ids: Sequence[int], size: int) -> list[list[int]]:
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


def publish_items(ids: Sequence[int], *, batch_size: int, countdown_s: float = 0.0) -> int:
    """Send ids as generate messages of at most batch_size ids; return messages sent."""
    sent = 0
    with celery_app.producer_or_acquire() as producer:
        for chunk in chunks(ids, batch_size):
            celery_app.send_task(
                GENERATE_TASK,
                args=[chunk],
                queue=WORK_QUEUE,
                countdown=countdown_s or None,
                argsrepr=f"[{len(chunk)} items: {chunk[0]}..{chunk[-1]}]",
                producer=producer,
            )
            sent += 1
    log.debug("published %d ids in %d messages", len(ids), sent)
    return sent
