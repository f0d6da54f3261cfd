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

    Nothing pauses if NAME does not answer, or if --model-path is a local path missing on this
    machine while NAME runs here. While it waits for the items in flight it counts down: on a
    terminal one line redrawn, in a pipe or a file a line when their number changes (and
    every 10 s while it does not).

    Exit status: 0 updated and serving; 1 not updated (refused before anything paused, or the
    update failed and NAME stays paused; the command to try again is printed); 3 updated, but
    NAME stays paused (no active run takes the new weights, or it was paused before); 2 a
    usage, settings or ledger error."""
    from rich.markup import escape

    from ops.views.progress import Progress
    from workers.control.pausing import CeleryControl
    from workers.control.weights_update import UpdateRequest, update_weights

    settings = get_settings()
    console = err_console()
    request = UpdateRequest(name, model_path, weight_version, load_format, drain_timeout_s)
    with Progress(console) as progress:
        result = update_weights(
            open_db(settings),
            settings,
            CeleryControl(),
            request,
            on_progress=progress.say,
            on_drain=lambda leased, left_s: progress.show([drain_line(name, leased, left_s)]),
        )
    colour = "green" if result.ok and not result.paused else "red" if not result.ok else "yellow"
    console.print(f"[{colour}]{escape(result.message)}[/{colour}]", markup=True, soft_wrap=True)
    if result.again is not None:
        console.print("To update again:", markup=False)
        console.print(result.again, markup=False, highlight=False, soft_wrap=True)
    if not result.ok:
        raise SystemExit(1)
    if result.paused:
        raise SystemExit(UPDATED_BUT_PAUSED)


UPDATED_BUT_PAUSED = 3  # the exit status of an update that loaded, with the server still paused
DRAIN_LINE_EVERY_S = 10  # in a pipe, an unchanged drain says it still waits this often


def drain_line(name: str, leased: int, left_s: float) -> Line:
    """The drain's line: what is still out and how long the wait has left."""
    from ops.views.progress import Line

    if leased == 0:
        return Line("drain", f"{name}: no item in flight", 0)
    text = f"{name}: waiting for {leased} in-flight items to finish or go back ({left_s:.0f}s left)"
    return Line("drain", text, (leased, int(left_s // DRAIN_LINE_EVERY_S)))
