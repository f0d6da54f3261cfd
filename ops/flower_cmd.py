"""The `tokenmill flower` command: Celery's Flower dashboard for this deployment's broker.

Basic auth comes from settings and covers every page but /healthcheck (Prometheus' /metrics
too); without a password it listens on loopback only, or refuses.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import click

from app.core.errors import ConfigurationError
from app.core.network import is_loopback
from ops.options import err_console, get_settings, handle_errors, setting_option

if TYPE_CHECKING:
    from app.core.settings import Settings


@dataclass(frozen=True)
class FlowerLaunch:
    """The command that runs Flower and the variables to set for it (the credentials travel
    as FLOWER_BASIC_AUTH, not on the command line, which `ps` shows to every local user)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None


def flower_launch(settings: Settings, host: str, port: int) -> FlowerLaunch:
    """How to run Flower on host:port with the configured credentials; raises
    ConfigurationError rather than expose it beyond loopback without a password."""
    password = settings.flower_password.get_secret_value() if settings.flower_password else ""
    user = settings.flower_user
    if not password and not is_loopback(host):
        raise ConfigurationError(
            f"refusing to serve Flower on {host or 'every interface'} without a password: set "
            "TOKENMILL_FLOWER_PASSWORD (user TOKENMILL_FLOWER_USER, default admin), or listen "
            "on 127.0.0.1"
        )
    if password and (not user or ":" in user or "," in user):
        raise ConfigurationError("TOKENMILL_FLOWER_USER must be non-empty, without ':' or ','")
    if "," in password:
        raise ConfigurationError("TOKENMILL_FLOWER_PASSWORD must not contain ','")
    # `celery -A app flower`, with /metrics behind the same basic auth (ops.flower_app)
    argv = [sys.executable, "-m", "ops.flower_app", f"--address={host}", f"--port={port}"]
    if not password:
        return FlowerLaunch(argv)
    return FlowerLaunch(argv, {"FLOWER_BASIC_AUTH": f"{user}:{password}"}, user)


@click.command("flower")
@setting_option(
    "--host",
    default=None,
    setting="TOKENMILL_FLOWER_HOST",
    shown_default="127.0.0.1",
    help="Address to listen on; beyond loopback TOKENMILL_FLOWER_PASSWORD is required.",
)
@setting_option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    setting="TOKENMILL_FLOWER_PORT",
    shown_default="5555",
    help="Port to listen on.",
)
@handle_errors
def flower_cmd(host: str | None, port: int | None) -> None:
    """Serve Flower (tasks, workers, queues) on the configured broker, behind basic auth
    from TOKENMILL_FLOWER_USER / TOKENMILL_FLOWER_PASSWORD."""
    settings = get_settings()
    if importlib.util.find_spec("flower") is None:
        raise ConfigurationError(
            "Flower is not installed (tokenmill depends on it): pip install 'flower>=2.0'"
        )
    host = settings.flower_host if host is None else host
    port = port or settings.flower_port
    launch = flower_launch(settings, host, port)
    shown = f"[{host}]" if ":" in host else host or "0.0.0.0"
    access = (
        f"basic auth as {launch.user}"
        if launch.user
        else "no authentication (loopback only; Flower's HTTP API stays disabled)"
    )
    from rich.markup import escape

    err_console().print(
        f"Flower on http://{escape(shown)}:{port}/, {escape(access)}", soft_wrap=True
    )
    sys.stderr.flush()
    for name, value in launch.env.items():
        os.putenv(name, value)  # for the exec'd process; nothing here reads it
    os.execv(launch.argv[0], launch.argv)


__all__ = ["FlowerLaunch", "flower_cmd", "flower_launch", "is_loopback"]
