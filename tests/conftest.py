"""Fixtures shared by every layer: real Postgres and Redis, SQLite ledgers, the fixture tokenizer.

Integration tests get a private Postgres database for the session, emptied between tests; a
SQLite ledger is a copy of one file migrated once per session.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import Engine, create_engine, text

from app.ledger import database, migrate

if TYPE_CHECKING:
    from app.prompts.tokenization import ChatTokenizer
    from tests.support.sglang_http.harness import SGLangServer

# Tests run the commands users type (`tokenmill`, `celery -A app worker`) by name: they are the
# scripts of the Python running the tests (a fresh venv's, which need not be on PATH).
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

PG_ADMIN_URL = os.environ.get(
    "TOKENMILL_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("TOKENMILL_TEST_REDIS_URL")
TABLES = ("events", "items", "servers", "runs")


@contextmanager
def private_database(prefix: str = "tokenmill_test") -> Iterator[str]:
    """A fresh Postgres database migrated to head, dropped afterwards: its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        engine = database.make_engine(url)
        migrate.upgrade(engine)
        engine.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database for this test session, migrated to head."""
    with private_database() as url:
        yield url


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = database.make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite ledger file migrated to head once per session, its WAL folded in: tests copy it
    (`migrated_sqlite`) rather than run every revision again."""
    file = tmp_path_factory.mktemp("sqlite-template") / "ledger.sqlite3"
    engine = database.make_engine(f"sqlite:///{file}")
    migrate.upgrade(engine)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()
    return file


def migrated_sqlite(template: Path, file: Path) -> Engine:
    """An engine on a copy of the migrated template at file (its folder made if missing)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, file)
    return database.make_engine(f"sqlite:///{file}")


@pytest.fixture
def sqlite_engine(tmp_path: Path, sqlite_template: Path) -> Iterator[Engine]:
    """A SQLite ledger at head of its own (tmp_path/ledger.sqlite3)."""
    engine = migrated_sqlite(sqlite_template, tmp_path / "ledger.sqlite3")
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest) -> Engine:
    """The ledger on each supported database."""
    name = "sqlite_engine" if request.param == "sqlite" else "pg_engine"
    engine: Engine = request.getfixturevalue(name)
    return engine


@pytest.fixture(scope="session")
def kimi_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from emulator.fixtures.kimi import ensure_kimi_tokenizer

    return ensure_kimi_tokenizer(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="session")
def kimi_tokenizer(kimi_tokenizer_dir: Path) -> ChatTokenizer:
    """The fixture tokenizer loaded once per session, for tests that only read it (a test
    that changes its tokenizer loads its own)."""
    from app.prompts.tokenization import load_tokenizer

    return load_tokenizer(kimi_tokenizer_dir)


@pytest.fixture(scope="session")
def sglang_server(
    tmp_path_factory: pytest.TempPathFactory, kimi_tokenizer_dir: Path
) -> Iterator[SGLangServer]:
    """SGLang 0.5.23's own HTTP server, the fake scheduler as its model, one per session:
    the fixture tokenizer's folder as the model path, `--context-length 128`, 8 running and
    64 queued requests at most."""
    from tests.support.sglang_http import harness

    folder = tmp_path_factory.mktemp("sglang-server")
    model = harness.model_folder(kimi_tokenizer_dir, folder / "model")
    flags = ("--context-length", "128", "--max-running-requests", "8")
    flags += ("--max-queued-requests", "64")
    with harness.running_sglang_server(model, folder / "server.log", *flags) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[str]:
    """A private real redis-server for this session (or TOKENMILL_TEST_REDIS_URL), so that
    concurrent test sessions never flush each other's queues."""
    if REDIS_URL:
        yield REDIS_URL
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    client.close()
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    yield redis_server
    client.flushdb()
    client.close()
