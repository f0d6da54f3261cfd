"""The `tokenmill` command line: one group, commands registered from their modules.

Global options set logging; every setting is also a `TOKENMILL_*` environment variable.
Start-up stays short: the command modules import only click at load time, and each command
imports the libraries it needs (SQLAlchemy, rich, pyarrow, alembic, httpx...) when it runs.
"""

from __future__ import annotations

import click

from ops.demo import demo_cmd
from ops.emulator_cmd import emulator
from ops.fleet_cmds import events_cmd, pause_cmd, restart_cmd, resume_cmd, servers_group
from ops.flower_cmd import flower_cmd
from ops.metrics_cmd import metrics_cmd
from ops.options import (
    get_settings,
    handle_errors,
    log_format_option,
    open_db,
    print_json,
    setup_logging,
)
from ops.parity_cmd import parity_cmd
from ops.pipeline_cmds import enqueue_cmd, export_cmd, reconcile_cmd, run_cmd
from ops.report import report_cmd
from ops.status_cmd import status_cmd
from ops.storage_cmds import archive_cmd, compact_cmd
from ops.verify_cmd import verify_cmd
from ops.weights_cmd import update_weights_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--log-level",
    envvar="TOKENMILL_LOG_LEVEL",
    default="WARNING",
    show_default=True,
    help="Logging level (env TOKENMILL_LOG_LEVEL).",
)
@log_format_option
def cli(log_level: str, log_format: str | None) -> None:
    """tokenmill: token-exact training sequences from prompt sets, via SGLang servers."""
    setup_logging(log_level, log_format)


@cli.group("db")
def db_group() -> None:
    """Ledger schema commands."""


@db_group.command("upgrade")
@handle_errors
def db_upgrade() -> None:
    """Apply every migration to the configured database (TOKENMILL_DATABASE_URL)."""
    from app.core.settings import redact_url
    from app.ledger.database import get_engine
    from app.ledger.migrate import current_revision, upgrade

    settings = get_settings()
    engine = get_engine(settings)
    upgrade(engine)
    click.echo(f"{redact_url(settings.resolved_database_url())} is at {current_revision(engine)}")


@db_group.command("current")
@handle_errors
def db_current() -> None:
    """Show the schema revision of the configured database."""
    from app.ledger.database import get_engine
    from app.ledger.migrate import current_revision, head_revision

    engine = get_engine()
    click.echo(f"current {current_revision(engine)} (latest {head_revision()})")


@cli.command("config")
@handle_errors
def config_cmd() -> None:
    """Show the effective configuration (passwords redacted)."""
    from app.core.settings import redact_options, redact_url

    s = get_settings()
    data = s.model_dump(mode="json")
    data["database_url"] = redact_url(s.resolved_database_url())
    data["broker_url"] = redact_url(s.resolved_broker_url())
    data["storage_url"] = s.resolved_storage_url()
    data["storage_options"] = redact_options(s.storage_options)
    data["embedded"] = s.embedded
    print_json(data)


for command in (
    enqueue_cmd,
    run_cmd,
    status_cmd,
    export_cmd,
    reconcile_cmd,
    demo_cmd,
    emulator,
    servers_group,
    pause_cmd,
    resume_cmd,
    restart_cmd,
    update_weights_cmd,
    events_cmd,
    flower_cmd,
    metrics_cmd,
    report_cmd,
    compact_cmd,
    archive_cmd,
    verify_cmd,
    parity_cmd,
):
    cli.add_command(command)

__all__ = ["cli", "main", "open_db"]


def main() -> None:
    cli(prog_name="tokenmill")
