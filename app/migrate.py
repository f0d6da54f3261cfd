"""Schema migrations driven from code: `tokenmill db upgrade` and the embedded auto-upgrade.

Alembic's scripts live in the `migrations` package; this module only points Alembic at them.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from app.errors import SchemaOutOfDate

log = logging.getLogger(__name__)


def migrations_dir() -> Path:
    spec = importlib.util.find_spec("migrations")
    if spec is None or spec.origin is None:
        raise RuntimeError("the tokenmill `migrations` package is not installed")
    return Path(spec.origin).parent


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str | None:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return script.get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to revision on the engine's database."""
    config = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
    log.info("database upgraded to %s", revision)


def check_current(engine: Engine) -> None:
    """Raise SchemaOutOfDate unless the database is at the latest migration."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutOfDate(
            f"the database schema is at {current or 'nothing'}, this tokenmill needs {head}: "
            "run `tokenmill db upgrade`"
        )


def ensure_schema(engine: Engine, *, auto_upgrade: bool) -> None:
    """Upgrade when allowed (the embedded SQLite ledger), else insist the schema is current."""
    if auto_upgrade:
        if current_revision(engine) != head_revision():
            upgrade(engine)
        return
    check_current(engine)
