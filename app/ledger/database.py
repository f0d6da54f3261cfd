"""Database engines and sessions, created lazily once per process (never at import time).

SQLite (embedded default) gets WAL and a busy timeout; Postgres gets a pre-pinged pool of a fixed
size (TOKENMILL_DB_POOL), each connection named after its process (`application_name`).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.pool import ConnectionPoolEntry, NullPool, PoolProxiedConnection

from app.core import process_name
from app.core.settings import Settings, get_settings

log = logging.getLogger(__name__)

_lock = threading.Lock()
_engines: dict[tuple[int, str], Engine] = {}
_dedicated: dict[tuple[int, str, str], Engine] = {}
_connect_args: weakref.WeakKeyDictionary[Engine, dict[str, Any]] = weakref.WeakKeyDictionary()


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


def postgres_connect_args(*, pooler: bool) -> dict[str, Any]:
    """psycopg's connection arguments: the process's name (app/core/process_name.py: an
    engine keeps the name its process had when it was made) and, behind a transaction pooler
    (PgBouncer's pool_mode=transaction), no server-side prepared statements (psycopg prepares
    a statement after 5 runs on a connection; the next transaction may run on another server
    connection, which never saw it)."""
    args: dict[str, Any] = {"application_name": process_name.process_name()}
    if pooler:
        args["prepare_threshold"] = None
    return args


def make_engine(url: str, *, pool_size: int = 8, pooler: bool = False) -> Engine:
    """A new engine for url, holding at most pool_size connections (Postgres); callers
    normally want `get_engine()`."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    args = postgres_connect_args(pooler=pooler)
    engine = create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=0,  # the bound: a thread waits for a connection instead of opening one
        pool_recycle=1800,
        connect_args=args,
    )
    _connect_args[engine] = args
    _NestedCheckouts().watch(engine)
    return engine


class _NestedCheckouts:
    """Warns when a thread takes a second connection of a bounded pool while it holds one:
    with every connection held that way, each such thread waits for the others for good
    (until the pool's timeout). Nothing in tokenmill does; the warning says where if it
    starts to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # thread id → connections it holds
        self._warned = False

    def watch(self, engine: Engine) -> None:
        event.listen(engine, "checkout", self._checkout)
        event.listen(engine, "checkin", self._checkin)

    def _checkout(
        self, _dbapi: Any, record: ConnectionPoolEntry, _proxy: PoolProxiedConnection
    ) -> None:
        thread = threading.get_ident()
        record.info["tm_thread"] = thread
        with self._lock:
            held = self._held.get(thread, 0)
            self._held[thread] = held + 1
            warn, self._warned = held and not self._warned, self._warned or bool(held)
        if warn:
            log.warning(
                "thread %s took a second database connection while holding one "
                "(a bounded pool can run out that way)",
                threading.current_thread().name,
                extra={"action": "nested_checkout"},
                stack_info=True,
            )

    def _checkin(self, _dbapi: Any, record: ConnectionPoolEntry) -> None:
        thread = record.info.pop("tm_thread", None)
        if thread is None:
            return
        with self._lock:
            left = self._held.get(thread, 0) - 1
            if left > 0:
                self._held[thread] = left
            else:
                self._held.pop(thread, None)


def get_engine(settings: Settings | None = None) -> Engine:
    """The engine of this process for the configured database (a forked child gets its own):
    a pool of TOKENMILL_DB_POOL - 1 connections shared by its threads (the one left is a
    lease heartbeat's, `dedicated_connection`)."""
    settings = settings or get_settings()
    url = settings.resolved_database_url()
    key = (os.getpid(), url)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = make_engine(url, pool_size=settings.db_pool - 1, pooler=settings.db_pooler)
            _engines[key] = engine
        return engine


def dedicated_connection(db: Engine) -> Connection:
    """A connection of its own for a thread that must never wait on the pool (a lease
    heartbeat): outside db's shared pool, with the arguments of db's connections (its name, its
    pooler's rule), closed for good when the caller closes it."""
    if db.dialect.name != "postgresql":
        return db.connect()
    args = _connect_args.get(db) or postgres_connect_args(pooler=False)
    key = (os.getpid(), db.url.render_as_string(hide_password=False), repr(sorted(args.items())))
    with _lock:
        engine = _dedicated.get(key)
        if engine is None:
            engine = create_engine(db.url, poolclass=NullPool, connect_args=args)
            _dedicated[key] = engine
    return engine.connect()
