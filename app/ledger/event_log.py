"""The events table: one row for each thing that happened to a run or a server, written here
and read back by app.ledger.registry and the dashboard."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, insert, select

from app.core.constants import EVENT_FINGERPRINT_MISMATCH, EVENT_FINGERPRINT_PINNED, EventKind
from app.ledger import common


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
        insert(common.events).values(
            at=common.utcnow(),
            kind=kind,
            run_id=run_id,
            server=server,
            message=message,
            details=details,
        )
    )


def has_event(conn: Connection, kind: EventKind, *, run_id: int, server: str) -> bool:
    """Whether an event of this kind was recorded for this run and server."""
    stmt = select(common.events.c.id).where(
        common.events.c.kind == kind,
        common.events.c.run_id == run_id,
        common.events.c.server == server,
    )
    return conn.execute(stmt.limit(1)).first() is not None


def latest_kind(
    conn: Connection, kinds: Sequence[EventKind], *, run_id: int, server: str
) -> str | None:
    """The kind of the latest event of these kinds for this run and server (None: none)."""
    stmt = (
        select(common.events.c.kind)
        .where(
            common.events.c.kind.in_(list(kinds)),
            common.events.c.run_id == run_id,
            common.events.c.server == server,
        )
        .order_by(common.events.c.id.desc())
        .limit(1)
    )
    kind: str | None = conn.execute(stmt).scalar()
    return kind


def runs_refused(conn: Connection, run_ids: Sequence[int]) -> dict[str, dict[int, str]]:
    """server → run id → why, for each of these runs a server's workers last found it does not
    serve (its latest fingerprint event for the run is a mismatch, not a pin)."""
    if not run_ids:
        return {}
    stmt = (
        select(
            common.events.c.server,
            common.events.c.run_id,
            common.events.c.kind,
            common.events.c.message,
        )
        .where(
            common.events.c.kind.in_([EVENT_FINGERPRINT_PINNED, EVENT_FINGERPRINT_MISMATCH]),
            common.events.c.run_id.in_(list(run_ids)),
            common.events.c.server.is_not(None),
        )
        .order_by(common.events.c.id)
    )
    latest: dict[tuple[str, int], tuple[str, str]] = {}
    for row in conn.execute(stmt):
        latest[(row.server, row.run_id)] = (row.kind, row.message)
    out: dict[str, dict[int, str]] = {}
    for (server, run_id), (kind, message) in latest.items():
        if kind == EVENT_FINGERPRINT_MISMATCH:
            out.setdefault(server, {})[run_id] = message
    return out
