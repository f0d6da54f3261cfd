"""The lease heartbeat of a window: renews its owner's leases every heartbeat_s on a thread and
a database connection of its own, until the window stops."""

from __future__ import annotations

import contextlib
import logging
import threading

from sqlalchemy import Connection, Engine

from app.ledger import claims, database
from workers.engine.window_types import WindowConfig

log = logging.getLogger(__name__)


def renew_leases(db: Engine, owner: str, config: WindowConfig, stopping: threading.Event) -> None:
    """Renew owner's leases every config.heartbeat_s until stopping is set. Nothing else runs
    on this thread or its connection (kept open between beats), so no slow query, pool wait
    or hung abort can make a beat late; a failed beat drops the connection and tries again
    next beat."""
    conn: Connection | None = None
    try:
        while not stopping.wait(config.heartbeat_s):
            try:
                if conn is None:
                    conn = database.dedicated_connection(db)
                with conn.begin():
                    database.limit_periodic(conn, timeout_s=max(1.0, config.heartbeat_s))
                    claims.extend_leases(
                        conn,
                        owner=owner,
                        lease_s=config.lease_s,
                        heartbeat_s=config.heartbeat_s,
                    )
            except Exception as exc:
                log.warning(
                    "lease heartbeat failed (%s); retrying next beat",
                    exc,
                    extra={"action": "heartbeat_failed"},
                )
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                conn = None
    finally:
        if conn is not None:
            conn.close()
