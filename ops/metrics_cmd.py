"""The `tokenmill metrics` command: serves the Prometheus metrics of ops.views.metrics over HTTP.

Kept apart from ops.views.metrics so that the CLI loads prometheus_client and SQLAlchemy only
when this command runs.
"""

from __future__ import annotations

import click

from ops.options import err_console, get_settings, handle_errors, open_db, setting_option


@click.command("metrics")
@setting_option(
    "--host",
    default=None,
    setting="TOKENMILL_METRICS_HOST",
    shown_default="127.0.0.1",
    help="Address to listen on; beyond loopback TOKENMILL_METRICS_USER and "
    "TOKENMILL_METRICS_PASSWORD are required.",
)
@setting_option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    setting="TOKENMILL_METRICS_PORT",
    shown_default="9464",
    help="Port to listen on.",
)
@handle_errors
def metrics_cmd(host: str | None, port: int | None) -> None:
    """Serve Prometheus metrics of the whole fleet, computed from the ledger and broker."""
    from ops.views.metrics import check_exposure, credentials_from, make_metrics_server

    settings = get_settings()
    host = settings.metrics_host if host is None else host
    port = settings.metrics_port if port is None else port
    credentials = credentials_from(settings)
    check_exposure(host, credentials)  # refuse before touching the database
    broker_url = settings.resolved_broker_url()
    server = make_metrics_server(
        engine=open_db(settings),
        broker_url=broker_url,
        host=host,
        port=port,
        credentials=credentials,
        cache_s=settings.metrics_cache_s,
    )
    auth = "basic auth" if credentials else "no auth"
    err_console().print(f"serving metrics on {server.url} ({auth}); Ctrl-C stops")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
