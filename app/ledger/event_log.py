"""The events table: one row for each thing that happened to a run or a server, written here
and read back by app.ledger.registry and the dashboard."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert

from app.ledger.common import events, utcnow


def record_event(
    conn: Connection,
    kind: str,
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
