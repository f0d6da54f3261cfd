"""The `update-weights` command: a thin shell over workers.control.weights_update."""

from __future__ import annotations

import click

from ops.options import err_console, get_settings, handle_errors, open_db, setting_option


@click.command("update-weights")
@click.argument("name")
@click.option("--model-path", required=True, help="The checkpoint the server loads.")
@click.option("--weight-version", default=None, help="The weight_version it then reports.")
@click.option(
    "--load-format",
    default=None,
    show_default="the server's own",
    help="SGLang's load format.",
)
@setting_option(
    "--drain-timeout-s",
    setting="TOKENMILL_DRAIN_TIMEOUT_S",
    shown_default="30",
    type=float,
    default=None,
    help="Wait this long for in-flight items to finish; the rest are aborted and go back.",
)
@handle_errors
def update_weights_cmd(
    name: str,
    model_path: str,
    weight_version: str | None,
    load_format: str | None,
    drain_timeout_s: float | None,
) -> None:
    """Load new weights on server NAME in place: pause it, let its items finish or go back,
    /update_weights_from_disk, check /model_info, resume it for the runs that take them."""
    from rich.markup import escape

    from workers.control.pausing import CeleryControl
    from workers.control.weights_update import update_weights

    settings = get_settings()
    console = err_console()
    result = update_weights(
        open_db(settings),
        settings,
        CeleryControl(),
        name,
        model_path=model_path,
        weight_version=weight_version,
        load_format=load_format,
        drain_timeout_s=drain_timeout_s,
        on_progress=lambda line: console.print(escape(line)),
    )
    colour = "green" if result.ok else "red"
    console.print(f"[{colour}]{escape(result.message)}[/{colour}]", markup=True, soft_wrap=True)
    if not result.ok:
        raise SystemExit(1)
