"""The `tokenmill` command line: one group, commands registered from their modules.

Global options set logging; every setting is also a `TOKENMILL_*` environment variable.
Start-up stays short: the command modules import only click at load time, and each command
imports the libraries it needs (SQLAlchemy, rich, pyarrow, alembic, httpx...) when it runs.
"""

from __future__ import annotations

import functools
import importlib
import io
import re
from collections.abc import Callable
from typing import IO, Any

import click

from app.core.constants import LOG_LEVELS
from ops.options import get_settings, handle_errors, log_format_option, print_json, setup_logging

# Each command loads with its module when it is run or listed (`tokenmill status` imports the
# status command's module only; `--help` lists them all, so it loads every command module,
# which import only click).
COMMANDS = {
    "enqueue": "ops.pipeline_cmd:enqueue_cmd",
    "run": "ops.run_cmd:run_cmd",
    "status": "ops.status_cmd:status_cmd",
    "export": "ops.export_cmd:export_cmd",
    "reconcile": "ops.pipeline_cmd:reconcile_cmd",
    "retry": "ops.retry_cmd:retry_cmd",
    "demo": "ops.demo_cmd:demo_cmd",
    "emulator": "ops.emulator_cmd:emulator",
    "servers": "ops.fleet_cmd:servers_group",
    "pause": "ops.fleet_cmd:pause_cmd",
    "resume": "ops.fleet_cmd:resume_cmd",
    "restart": "ops.fleet_cmd:restart_cmd",
    "update-weights": "ops.weights_cmd:update_weights_cmd",
    "events": "ops.fleet_cmd:events_cmd",
    "flower": "ops.flower_cmd:flower_cmd",
    "metrics": "ops.metrics_cmd:metrics_cmd",
    "report": "ops.report_cmd:report_cmd",
    "compact": "ops.storage_cmd:compact_cmd",
    "archive": "ops.storage_cmd:archive_cmd",
    "delete": "ops.delete_cmd:delete_cmd",
    "verify": "ops.verify_cmd:verify_cmd",
    "parity": "ops.parity_cmd:parity_cmd",
    "accept": "ops.accept_cmd:accept_cmd",
    "priority": "ops.priority_cmd:priority_cmd",
}


class LazyGroup(click.Group):
    """A click group whose COMMANDS are imported on first use; click's own errors (parsing the
    command line) in the house wording."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:
            _in_house_words(exc)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            _in_house_words(exc)
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, attr = COMMANDS[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)


def _in_house_words(exc: click.ClickException) -> None:
    """Have exc shown as every other error line is: click's usage and hint lines as click
    writes them, then `error: …` where click writes `Error: …`."""
    if not isinstance(exc.show, functools.partial):  # not yet (a subcommand's, passing up)
        exc.show = functools.partial(_show_in_house_words, exc.show)  # type: ignore[method-assign]


def _show_in_house_words(
    show: Callable[[IO[Any] | None], None], file: IO[Any] | None = None
) -> None:
    shown = io.StringIO()
    show(shown)
    text = re.sub(r"^Error: ", "error: ", shown.getvalue(), count=1, flags=re.MULTILINE)
    click.echo(text, file=file, err=file is None, nl=False)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--log-level",
    envvar="TOKENMILL_LOG_LEVEL",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="WARNING",
    show_default=True,
    show_envvar=True,
    help="Logging level.",
)
@log_format_option
def cli(log_level: str, log_format: str | None) -> None:
    """tokenmill: token-exact training sequences from prompt sets, via SGLang servers.

    Settings are TOKENMILL_* environment variables: TOKENMILL_DATABASE_URL (the ledger),
    TOKENMILL_BROKER_URL and TOKENMILL_STORAGE_URL; unset, everything runs embedded on this
    machine. `tokenmill config` shows the effective configuration.
    """
    from app.core.process_name import name_process

    setup_logging(log_level, log_format)
    # its connections say which command holds them (pg_stat_activity's application_name)
    name_process(f"tokenmill {click.get_current_context().invoked_subcommand or ''}".strip())


@cli.group("db")
def db_group() -> None:
    """Ledger schema commands."""


@db_group.command("upgrade")
@handle_errors
def db_upgrade() -> None:
    """Apply every migration to the configured database (TOKENMILL_DATABASE_URL)."""
    from app.core.settings import redact_url
    from app.ledger import database, migrate

    settings = get_settings()
    engine = database.get_engine(settings)
    migrate.upgrade(engine)
    click.echo(
        f"{redact_url(settings.resolved_database_url())} is at {migrate.current_revision(engine)}"
    )


@db_group.command("current")
@handle_errors
def db_current() -> None:
    """Show the schema revision of the configured database."""
    from app.ledger import database, migrate

    engine = database.get_engine()
    click.echo(f"current {migrate.current_revision(engine)} (latest {migrate.head_revision()})")


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


__all__ = ["cli", "main"]


def main() -> None:
    cli(prog_name="tokenmill")
