"""The `update-weights` command: a thin shell over workers.control.weights_update."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ops.options import err_console, get_settings, handle_errors, open_db, setting_option

if TYPE_CHECKING:
    from ops.views.progress import Line


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
    /update_weights_from_disk, check /model_info, resume it for the runs that take them.

    While it waits for the items in flight it counts down: on a terminal one line redrawn, in
    a pipe or a file a line when their number changes (and every 10 s while it does not)."""
    from rich.markup import escape

    from ops.views.progress import Progress
    from workers.control.pausing import CeleryControl
    from workers.control.weights_update import update_weights

    settings = get_settings()
    console = err_console()
    with Progress(console) as progress:
        result = update_weights(
            open_db(settings),
            settings,
            CeleryControl(),
            name,
            model_path=model_path,
            weight_version=weight_version,
            load_format=load_format,
            drain_timeout_s=drain_timeout_s,
            on_progress=progress.say,
            on_drain=lambda leased, left_s: progress.show([drain_line(name, leased, left_s)]),
        )
    colour = "green" if result.ok else "red"
    console.print(f"[{colour}]{escape(result.message)}[/{colour}]", markup=True, soft_wrap=True)
    if not result.ok:
        raise SystemExit(1)


DRAIN_LINE_EVERY_S = 10  # in a pipe, an unchanged drain says it still waits this often


def drain_line(name: str, leased: int, left_s: float) -> Line:
    """The drain's line: what is still out and how long the wait has left."""
    from ops.views.progress import Line

    if leased == 0:
        return Line("drain", f"{name}: no item in flight", 0)
    text = f"{name}: waiting for {leased} in-flight items to finish or go back ({left_s:.0f}s left)"
    return Line("drain", text, (leased, int(left_s // DRAIN_LINE_EVERY_S)))
