"""Migration 0012: items that failed before it keep the start of their error as their reason
(so status, verify and retry see them), other items have none; downgrade drops the column."""

from __future__ import annotations

from alembic import command
from sqlalchemy import Engine, inspect, text

from app.ledger import migrate, retries
from tests.support.runs import add_item, make_run


def test_earlier_failures_get_their_error_as_reason(sqlite_engine: Engine) -> None:
    with sqlite_engine.begin() as conn:
        run = make_run(conn, "old")
        add_item(conn, run.id, "f1", status="failed", error="permanent: HTTP 400: too long")
        add_item(conn, run.id, "f2", status="failed", error=None)
        add_item(conn, run.id, "d1", completion_tokens=3)
    config = migrate.alembic_config(str(sqlite_engine.url))
    with sqlite_engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0011")
    assert "fail_reason" not in {c["name"] for c in inspect(sqlite_engine).get_columns("items")}
    migrate.upgrade(sqlite_engine)
    with sqlite_engine.connect() as conn:
        reasons = dict(
            conn.execute(text("SELECT item_key, fail_reason FROM items ORDER BY item_key")).all()
        )
        counted = retries.failed_by_reason(conn, run.id)
    assert reasons == {
        "d1": None,
        "f1": "permanent: HTTP 400: too long",
        "f2": "(no error recorded)",
    }
    assert counted == [("(no error recorded)", 1), ("permanent: HTTP 400: too long", 1)]
