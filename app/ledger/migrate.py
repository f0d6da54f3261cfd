"""Schema migrations driven from code: `tokenmill db upgrade` and the embedded auto-upgrade.

Alembic's scripts live in the `migrations` package; this module only points Alembic at them.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from app.core.errors import SchemaOutOfDate

# alembic loads only to upgrade, or when the quick schema check below cannot decide: every
# CLI command checks the schema, and importing alembic costs a fifth of a second.
if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)


def migrations_dir() -> Path:
    spec = importlib.util.find_spec("migrations")
    if spec is None or spec.origin is None:
        raise RuntimeError("the tokenmill `migrations` package is not installed")
    return Path(spec.origin).parent


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return script.get_current_head()


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to revision on the engine's database."""
    from alembic import command

    config = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
    log.info("database upgraded to %s", revision, extra={"action": "upgraded"})


def check_current(engine: Engine) -> None:
    """Raise SchemaOutOfDate unless the database is at the latest migration."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        raise SchemaOutOfDate(
            f"the database schema is at {current or 'nothing'}, this tokenmill needs {head}: "
            "run `tokenmill db upgrade`"
        )


def declared_head() -> str | None:
    """The one head revision the migration scripts declare, read from their source without
    running them (or alembic); None when that is not certain (several heads, a revision not
    written as a plain string), and alembic's own answer is needed."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in sorted((migrations_dir() / "versions").glob("*.py")):
        if path.name == "__init__.py":
            continue
        values = _module_constants(path, ("revision", "down_revision"))
        revision, down = values.get("revision"), values.get("down_revision")
        if not isinstance(revision, str) or "down_revision" not in values:
            return None
        revisions.add(revision)
        if isinstance(down, str):
            parents.add(down)
        elif isinstance(down, tuple | list) and all(isinstance(d, str) for d in down):
            parents.update(down)
        elif down is not None:
            return None
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def _module_constants(path: Path, names: tuple[str, ...]) -> dict[str, object]:
    """Top-level assignments of these names in a Python file, as literals (`...` when the
    value is not a literal)."""
    found: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        target: ast.expr
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in names:
            try:
                found[target.id] = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError):
                found[target.id] = ...
    return found


def stored_revision(engine: Engine) -> str | None:
    """The revision recorded in the database's alembic_version table; None if there is none."""
    try:
        with engine.connect() as conn:
            rows = list(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())
    except SQLAlchemyError:  # no table yet: an empty database
        return None
    return str(rows[0]) if len(rows) == 1 else None


def ensure_schema(engine: Engine, *, auto_upgrade: bool) -> None:
    """Upgrade when allowed (the embedded SQLite ledger), else insist the schema is current."""
    head = declared_head()
    if head is not None and stored_revision(engine) == head:
        return  # current: the common case, decided without loading alembic
    if auto_upgrade:
        if current_revision(engine) != head_revision():
            upgrade(engine)
        return
    check_current(engine)
