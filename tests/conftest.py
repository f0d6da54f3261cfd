"""Fixtures shared by every layer: real Postgres and Redis, SQLite ledgers, the fixture tokenizer.

Integration tests get a private Postgres database for the session, emptied between tests.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from app.database import make_engine
from app.migrate import upgrade

PG_ADMIN_URL = os.environ.get(
    "TOKENMILL_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("TOKENMILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
TABLES = ("events", "items", "servers", "runs")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh Postgres database for this test session, migrated to head."""
    name = f"tokenmill_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    yield engine
    engine.dispose()


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    upgrade(engine)
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
    from app.fixtures import ensure_kimi_tokenizer

    return ensure_kimi_tokenizer(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture
def redis_url() -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield REDIS_URL
    client.flushdb()
    client.close()
