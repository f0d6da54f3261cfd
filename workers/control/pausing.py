"""Pausing and resuming a server's workers: the durable ledger flag, an event, and Celery
remote control (`cancel_consumer` / `add_consumer`) aimed at that server's workers.

The flag is the truth; the broadcast is the fast path (workers also enforce the flag).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from sqlalchemy import Engine

from app.core.constants import (
    EVENT_PAUSED,
    EVENT_RESUMED,
    PAUSED_BY_OPERATOR,
    PAUSED_BY_RESTART,
    WORK_QUEUE,
    EventKind,
    PauseReason,
)
from app.ledger import event_log, registry

log = logging.getLogger(__name__)


class WorkerControl(Protocol):
    def cancel_consumer(self, workers: list[str]) -> None: ...

    def add_consumer(self, workers: list[str]) -> None: ...


class CeleryControl:
    """Remote control through the broker; a worker that misses it still honours the flag."""

    def cancel_consumer(self, workers: list[str]) -> None:
        self._send("cancel_consumer", workers)

    def add_consumer(self, workers: list[str]) -> None:
        self._send("add_consumer", workers)

    def _send(self, command: str, workers: list[str]) -> None:
        if not workers:
            return
        from app.celery_app import celery_app

        try:
            getattr(celery_app.control, command)(WORK_QUEUE, destination=workers, reply=False)
            log.info(
                "%s %s sent to %s",
                command,
                WORK_QUEUE,
                ", ".join(workers),
                extra={"action": "control_sent"},
            )
        except Exception as exc:  # the flag still pauses them
            log.warning(
                "%s to %s failed (%s); workers enforce the flag",
                command,
                workers,
                exc,
                extra={"action": "control_failed"},
            )


# Which workers of these names answer now (a Celery ping); raises when it cannot tell.
AliveWorkers = Callable[[list[str]], set[str]]


def alive_workers(names: list[str], *, timeout_s: float = 1.0) -> set[str]:
    """Which of these Celery workers answer a ping now; raises when the broker cannot tell."""
    if not names:
        return set()
    from app.celery_app import celery_app

    replies = celery_app.control.ping(destination=names, timeout=timeout_s, limit=len(names))
    return {name for reply in replies for name in reply}


def set_server_paused(
    db: Engine, control: WorkerControl, name: str, paused: bool, *, by: PauseReason, reason: str
) -> bool:
    """Pause (or resume) a server's workers; return True if the flag changed."""
    kind: EventKind = EVENT_PAUSED if paused else EVENT_RESUMED
    with db.begin() as conn:
        changed = registry.set_paused(
            conn, name, paused, by=by if paused else None, reason=reason if paused else None
        )
        workers = registry.get_server(conn, name).workers
        if changed:
            event_log.record_event(
                conn,
                kind,
                f"{name} {kind} by {by}: {reason}",
                server=name,
                details={"by": by, "workers": workers},
            )
    if paused:
        control.cancel_consumer(workers)
    else:
        control.add_consumer(workers)
    if changed:
        # what the watchdog, a parity or a fingerprint check decides is news in a worker's log;
        # an operator's pause or resume, and a restart's, are printed by their own command
        asked = by in (PAUSED_BY_OPERATOR, PAUSED_BY_RESTART)
        level = logging.WARNING if paused and not asked else logging.INFO
        log.log(level, "server %s %s by %s: %s", name, kind, by, reason)
    return changed


def pause_server(
    db: Engine, control: WorkerControl, name: str, *, by: PauseReason, reason: str
) -> bool:
    return set_server_paused(db, control, name, True, by=by, reason=reason)


def resume_server(
    db: Engine, control: WorkerControl, name: str, *, by: PauseReason, reason: str
) -> bool:
    return set_server_paused(db, control, name, False, by=by, reason=reason)
