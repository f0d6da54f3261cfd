"""The events table: one row for each thing that happened to a run or a server, written here
and read back by app.ledger.registry and the dashboard."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, select

from app.core.constants import EventKind
from app.ledger.common import events, utcnow


def record_event(
    conn: Connection,
    kind: EventKind,
    message: str,
    *,
    run_id: int | None = None,
    server: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    conn.execute(
        insert(events).values(
            at=utcnow(), kind=kind, run_id=run_id, server=server, message=message, details=details
        )
    )


def has_event(conn: Connection, kind: EventKind, *, run_id: int, server: str) -> bool:
    """Whether an event of this kind was recorded for this run and server."""
    stmt = select(events.c.id).where(
        events.c.kind == kind, events.c.run_id == run_id, events.c.server == server
    )
    return conn.execute(stmt.limit(1)).first() is not None
