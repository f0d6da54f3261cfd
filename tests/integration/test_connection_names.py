"""Each Postgres connection says which process holds it (application_name): a CLI command's its
command, a worker's its server; the engine's pool holds at most TOKENMILL_DB_POOL - 1, and a
lease heartbeat's connection is its own, beside the pool."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, text

from app.core import process_name
from app.core.settings import Settings
from app.ledger import database
from ops.cli import cli


@pytest.fixture
def named() -> Iterator[None]:
    before = process_name.process_name()
    yield
    process_name.name_process(before)


def test_a_cli_command_names_the_process(named: None) -> None:
    done = CliRunner().invoke(cli, ["config"])
    assert done.exit_code == 0, done.output
    assert process_name.process_name() == "tokenmill config"


def test_a_long_name_is_cut_to_what_postgres_keeps(named: None) -> None:
    process_name.name_process("tokenmill-worker " + "é" * 40)
    assert len(process_name.process_name().encode()) <= 63


def test_connections_carry_the_name_and_the_pool_is_bounded(pg_url: str, named: None) -> None:
    process_name.name_process("tokenmill-worker gpu-z:30000")
    engine = database.make_engine(pg_url, pool_size=2)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW application_name")).scalar() == (
                "tokenmill-worker gpu-z:30000"
            )
        assert engine.pool.size() == 2  # type: ignore[attr-defined]
        held = [engine.connect(), engine.connect()]
        waited = threading.Event()

        def third() -> None:
            with engine.connect():
                waited.set()

        thread = threading.Thread(target=third)
        thread.start()
        assert not waited.wait(0.5)  # no third connection: it waits for one to come back
        held.pop().close()
        thread.join(timeout=30)
        assert waited.is_set()
        held.pop().close()
    finally:
        engine.dispose()


def test_the_heartbeat_connection_is_outside_the_pool(pg_url: str, named: None) -> None:
    settings = Settings(database_url=pg_url, db_pool=2)
    engine = database.make_engine(settings.resolved_database_url(), pool_size=settings.db_pool - 1)
    try:
        with engine.connect() as shared, database.dedicated_connection(engine) as own:
            pids = {c.execute(text("SELECT pg_backend_pid()")).scalar() for c in (shared, own)}
            assert len(pids) == 2
    finally:
        engine.dispose()


def prepared_after_ten_runs(engine: Engine) -> int:
    with engine.connect() as conn:
        for _ in range(10):  # psycopg prepares a statement from its 5th run by default
            conn.execute(text("SELECT 1")).scalar()
        count = conn.execute(text("SELECT count(*) FROM pg_prepared_statements")).scalar()
    return int(count or 0)


def test_behind_a_pooler_no_statement_is_prepared(pg_url: str, named: None) -> None:
    direct = database.make_engine(pg_url)
    try:
        assert prepared_after_ten_runs(direct) > 0  # what a transaction pooler would break
    finally:
        direct.dispose()
    engine: Engine = database.make_engine(pg_url, pooler=True)
    try:
        assert prepared_after_ten_runs(engine) == 0
        with engine.connect():
            dedicated = database.dedicated_connection(engine)
            dbapi = dedicated.connection.driver_connection
            assert dbapi is not None and dbapi.prepare_threshold is None
            dedicated.close()
    finally:
        engine.dispose()
