"""The migrations build exactly the schema the models describe, on Postgres and SQLite, and
downgrade cleanly; the embedded ledger upgrades itself, a stale Postgres one is refused."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect

from app.core.errors import SchemaOutOfDate
from app.core.models import metadata
from app.ledger import migrate


def test_models_match_migrations(db: Engine) -> None:
    with db.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, metadata)
    assert diff == []
    assert migrate.current_revision(db) == migrate.head_revision()


def test_downgrade_to_nothing_and_back(sqlite_engine: Engine) -> None:
    from alembic import command

    config = migrate.alembic_config(str(sqlite_engine.url))
    with sqlite_engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    assert set(inspect(sqlite_engine).get_table_names()) <= {"alembic_version"}
    migrate.upgrade(sqlite_engine)
    assert {"runs", "items", "servers", "events"} <= set(inspect(sqlite_engine).get_table_names())


def test_an_unmigrated_database_is_refused(tmp_path: object) -> None:
    from app.ledger import database

    engine = database.make_engine(f"sqlite:///{tmp_path}/empty.sqlite3")
    with pytest.raises(SchemaOutOfDate, match="tokenmill db upgrade"):
        migrate.check_current(engine)


def test_runs_created_before_the_kind_column_generate(sqlite_engine: Engine) -> None:
    """0021 adds runs.kind: a run written under 0020 reads back as a generation run."""
    from alembic import command
    from sqlalchemy import text

    from app.core.run_kinds import RunKind, TurnsMode
    from app.ledger import run_queries

    config = migrate.alembic_config(str(sqlite_engine.url))
    with sqlite_engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0020")
    assert "kind" not in {c["name"] for c in inspect(sqlite_engine).get_columns("runs")}
    with sqlite_engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (name, tokenizer_path, tokenizer_hash, chat_template_hash, "
                "chat_template_kwargs, sampling_params, samples_per_prompt, eos_token_ids, "
                "created_at) VALUES ('old', '/t', 'a', 'b', '{}', '{\"turns\": \"all\"}', 1, "
                "'[]', '2026-12-01 00:00:00')"
            )
        )
    migrate.upgrade(sqlite_engine)
    with sqlite_engine.connect() as conn:
        run = run_queries.get_run(conn, "old")
    assert run.kind is RunKind.GENERATE
    assert run.generation.turns is TurnsMode.ALL
