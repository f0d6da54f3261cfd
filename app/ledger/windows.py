"""The ledger's record of the windows: named queries on `server_windows`, one row per server and
worker (lease owner) with the size it keeps in flight and what sized it.

A worker writes its row every few seconds while it runs and deletes it when it stops; the rows
written recently are the workers that share a server's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from app.core.models import server_windows
from app.ledger import common

FRESH_S = 30.0  # a row older than this is a worker gone: its share goes to the others


@dataclass(frozen=True)
class WindowRow:
    server: str
    owner: str
    mode: str  # "auto" | "fixed"
    size: int
    max_running: int | None = None
    max_total_tokens: int | None = None
    running: int | None = None
    queued: int | None = None
    reason: str | None = None
    changed_at: datetime | None = None
    updated_at: datetime | None = None
    loads_at: datetime | None = None  # when running and queued were read

    def to_json(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "mode": self.mode,
            "size": self.size,
            "max_running": self.max_running,
            "max_total_tokens": self.max_total_tokens,
            "running": self.running,
            "queued": self.queued,
            "reason": self.reason,
            "changed_at": self.changed_at.isoformat() if self.changed_at else None,
            "updated_at": self.updated_at.isoformat() if self.updated_at else None,
            "loads_at": self.loads_at.isoformat() if self.loads_at else None,
        }


def record_window(conn: Connection, row: WindowRow) -> None:
    """Write this worker's row (insert or replace); updated_at is now."""
    values = {
        "server": row.server,
        "owner": row.owner,
        "mode": row.mode,
        "size": row.size,
        "max_running": row.max_running,
        "max_total_tokens": row.max_total_tokens,
        "running": row.running,
        "queued": row.queued,
        "reason": row.reason,
        "changed_at": row.changed_at,
        "updated_at": common.utcnow(),
        "loads_at": row.loads_at,
    }
    changed = {k: v for k, v in values.items() if k not in ("server", "owner")}
    if conn.dialect.name == "postgresql":
        pg = pg_insert(server_windows).values(values)
        conn.execute(pg.on_conflict_do_update(index_elements=["server", "owner"], set_=changed))
        return
    if conn.dialect.name == "sqlite":
        lite = sqlite_insert(server_windows).values(values)
        conn.execute(lite.on_conflict_do_update(index_elements=["server", "owner"], set_=changed))
        return
    found = conn.execute(
        update(server_windows)
        .where(server_windows.c.server == row.server, server_windows.c.owner == row.owner)
        .values(changed)
    )
    if found.rowcount == 0:
        conn.execute(server_windows.insert().values(values))


def drop_window(conn: Connection, server: str, owner: str) -> None:
    """This worker no longer serves the server: its share goes to the others."""
    conn.execute(
        delete(server_windows).where(
            server_windows.c.server == server, server_windows.c.owner == owner
        )
    )


def sharing_owners(conn: Connection, server: str, *, fresh_s: float) -> list[str]:
    """The workers (lease owners) whose row of this server was written in the last fresh_s. A
    server registered under several names (one URL) is one server: the workers of each name
    share its one capacity, so two registrations do not each take all of it."""
    since = common.utcnow() - timedelta(seconds=fresh_s)
    url = select(common.servers.c.url).where(common.servers.c.name == server).scalar_subquery()
    same_server = select(common.servers.c.name).where(common.servers.c.url == url)
    rows = conn.execute(
        select(server_windows.c.owner).where(
            or_(server_windows.c.server == server, server_windows.c.server.in_(same_server)),
            server_windows.c.updated_at >= since,
            server_windows.c.mode == "auto",
        )
    )
    return sorted({r.owner for r in rows})


def _row(r: Any) -> WindowRow:
    return WindowRow(
        server=r.server,
        owner=r.owner,
        mode=r.mode,
        size=r.size,
        max_running=r.max_running,
        max_total_tokens=r.max_total_tokens,
        running=r.running,
        queued=r.queued,
        reason=r.reason,
        changed_at=common.as_utc(r.changed_at),
        updated_at=common.as_utc(r.updated_at),
        loads_at=common.as_utc(r.loads_at),
    )


def windows_by_server(
    conn: Connection, servers: list[str], *, fresh_s: float
) -> dict[str, list[WindowRow]]:
    """The fresh rows of these servers (written in the last fresh_s), by server."""
    if not servers:
        return {}
    since = common.utcnow() - timedelta(seconds=fresh_s)
    rows = conn.execute(
        select(server_windows)
        .where(server_windows.c.server.in_(servers), server_windows.c.updated_at >= since)
        .order_by(server_windows.c.server, server_windows.c.owner)
    )
    out: dict[str, list[WindowRow]] = {}
    for r in rows:
        out.setdefault(r.server, []).append(_row(r))
    return out


@dataclass(frozen=True)
class ServerWindow:
    """A server's window as its workers keep it: their sizes added up."""

    mode: str  # "auto", "fixed" or "mixed"
    size: int
    max_running: int | None
    running: int | None
    queued: int | None
    reason: str | None
    workers: int
    loads_at: datetime | None = None  # when running and queued were read

    def load_age_s(self, now: datetime) -> float | None:
        """How old the running and queued figures are (None: never read)."""
        return None if self.loads_at is None else max(0.0, (now - self.loads_at).total_seconds())

    def describe(self) -> str:
        """`auto: 272 (max_running 256)`, or `fixed: 64`."""
        text = f"{self.mode}: {self.size}"
        return text + (f" (max_running {self.max_running})" if self.max_running else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "size": self.size,
            "max_running": self.max_running,
            "running": self.running,
            "queued": self.queued,
            "reason": self.reason,
            "workers": self.workers,
            "loads_at": self.loads_at.isoformat() if self.loads_at else None,
            "text": self.describe(),
        }


def server_window(rows: list[WindowRow]) -> ServerWindow | None:
    """The server's window from its workers' rows (None: no worker wrote one lately)."""
    if not rows:
        return None
    modes = {r.mode for r in rows}
    now = common.utcnow()
    latest = max(rows, key=lambda r: r.updated_at or now)
    changed = [r for r in rows if r.changed_at is not None]
    last_change = max(changed, key=lambda r: r.changed_at or now) if changed else None
    return ServerWindow(
        mode=modes.pop() if len(modes) == 1 else "mixed",
        size=sum(r.size for r in rows),
        max_running=latest.max_running,
        running=latest.running,
        queued=latest.queued,
        reason=last_change.reason if last_change else latest.reason,
        workers=len(rows),
        loads_at=latest.loads_at,
    )
