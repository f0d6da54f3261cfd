"""Migration 0005b moves a `--turns all` run's trust_remote_code out of its sampling_params
JSON into the new column (and back on downgrade); other runs read False."""

from __future__ import annotations

from alembic import command
from sqlalchemy import Engine, text

from app.ledger import migrate, run_queries


def _insert_run(engine: Engine, name: str, sampling: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (name, tokenizer_path, tokenizer_hash, chat_template_hash, "
                "chat_template_kwargs, sampling_params, samples_per_prompt, eos_token_ids, "
                "created_at) VALUES (:name, '/t', :h, :h, '{}', :sampling, 1, '[]', "
                "'2026-11-30 00:00:00')"
            ),
            {"name": name, "h": "a" * 64, "sampling": sampling},
        )


def test_the_pinned_flag_moves_to_its_column_and_back(sqlite_engine: Engine) -> None:
    config = migrate.alembic_config(str(sqlite_engine.url))
    with sqlite_engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0004")
    _insert_run(
        sqlite_engine, "trusted", '{"max_new_tokens": 8, "turns": "all", "trust_remote_code": true}'
    )
    _insert_run(sqlite_engine, "plain", '{"max_new_tokens": 8}')
    migrate.upgrade(sqlite_engine)
    with sqlite_engine.connect() as conn:
        trusted, plain = run_queries.get_run(conn, "trusted"), run_queries.get_run(conn, "plain")
        stored = conn.execute(text("SELECT sampling_params FROM runs WHERE name = 'trusted'"))
        assert "trust_remote_code" not in stored.scalar_one()
    assert (trusted.generation.trust_remote_code, trusted.generation.turns) == (True, "all")
    assert trusted.generation.tokenizer_files is None
    assert plain.generation.trust_remote_code is False
    with sqlite_engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "0004")
    with sqlite_engine.connect() as conn:
        back = conn.execute(text("SELECT sampling_params FROM runs WHERE name = 'trusted'"))
        assert '"trust_remote_code": true' in back.scalar_one()
