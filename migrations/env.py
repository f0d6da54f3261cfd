"""Alembic environment: the database URL comes from tokenmill's settings.

Runs online migrations against the configured ledger (or a connection passed in).
"""

from __future__ import annotations

from alembic import context

from app.core.models import metadata
from app.core.settings import get_settings
from app.ledger import database

config = context.config
target_metadata = metadata


def run_migrations() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(
            connection=connection, target_metadata=target_metadata, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url") or get_settings().resolved_database_url()
    engine = database.make_engine(url)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("tokenmill migrations run online only: use `tokenmill db upgrade`")
run_migrations()
