"""Database engines and sessions, created lazily once per process (never at import time).

SQLite (embedded default) gets WAL and a busy timeout; Postgres gets a pre-pinged pool.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text

from app.core.settings import Settings, fixed_inflight, get_settings

_lock = threading.Lock()
_engines: dict[tuple[int, str], Engine] = {}


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


# what a periodic query (hedge search, watchdog lookups, reconcile, compaction scans) may
# take before Postgres cancels it: a plan gone wrong fails loudly instead of holding a timer
PERIODIC_TIMEOUT_S = 5.0
SCAN_TIMEOUT_S = 60.0


def limit_periodic(conn: Connection, *, timeout_s: float = PERIODIC_TIMEOUT_S) -> None:
    """Postgres: for the rest of this transaction, a statement timeout, no JIT (a compile
    costs more than these queries take) and the index plans pinned (pin_index_plans).
    SQLite: nothing to set."""
    if conn.dialect.name != "postgresql":
        return
    conn.execute(
        text(
            "SELECT set_config('statement_timeout', :ms, true), set_config('jit', 'off', true), "
            "set_config('enable_seqscan', 'off', true), set_config('enable_sort', 'off', true), "
            "set_config('enable_incremental_sort', 'off', true)"
        ),
        {"ms": str(max(1, int(timeout_s * 1000)))},
    )


def pin_index_plans(conn: Connection) -> None:
    """Postgres: for the rest of this transaction, price sequential scans and sorts out of
    the planner's choice (`enable_seqscan`, `enable_sort`, `enable_incremental_sort` off: an
    index on status alone plus an incremental sort looked cheaper for a status the
    statistics say is empty), so that a query whose ORDER
    BY an index delivers reads that index however stale the statistics are. After a big
    enqueue the statistics say every item is pending; a page of done items then looked as
    cheap read through any index and sorted as through the right one, and was 70x slower."""
    if conn.dialect.name != "postgresql":
        return
    conn.execute(
        text(
            "SELECT set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true), "
            "set_config('enable_sort', 'off', true), "
            "set_config('enable_incremental_sort', 'off', true)"
        )
    )


def make_engine(url: str, *, pool_size: int = 8) -> Engine:
    """A new engine for url; callers normally want `get_engine()`."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_recycle=1800,
    )


def get_engine(settings: Settings | None = None) -> Engine:
    """The engine of this process for the configured database (a forked child gets its own)."""
    settings = settings or get_settings()
    url = settings.resolved_database_url()
    key = (os.getpid(), url)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = make_engine(url, pool_size=max(4, min(fixed_inflight(settings, 64) // 4, 32)))
            _engines[key] = engine
        return engine
