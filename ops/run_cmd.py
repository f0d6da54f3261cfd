"""`tokenmill run`: enqueue, then generate in this process against `--server` URLs until the
run is done, with a live view of each server (ok, down for how long, why; plain lines in a
pipe) and a Ctrl-C that counts down what it waits for and prints the command that continues.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ops.options import (
    counted,
    err_console,
    field_option,
    get_settings,
    handle_errors,
    open_db,
    print_json,
    priority_option,
    render_options,
    sampling_options,
)
from ops.pipeline_cmd import enqueue_input

if TYPE_CHECKING:
    from app.core.settings import Settings
    from app.ledger import reads
    from workers.engine.runner import EmbeddedRunner


@click.command("run")
@click.argument("input_path", type=click.Path(path_type=Path))
@click.option("--run", "run_name", required=True, help="Run name.")
@click.option("--tokenizer", "tokenizer_path", required=True, help="Local tokenizer folder.")
@click.option(
    "--server",
    "servers",
    multiple=True,
    required=True,
    help="SGLang server URL; repeat for several servers.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the final counts as JSON.")
@field_option
@sampling_options
@render_options
@priority_option
@handle_errors
def run_cmd(
    input_path: Path,
    run_name: str,
    tokenizer_path: str,
    servers: tuple[str, ...],
    as_json: bool,
    **opts: Any,
) -> None:
    """Enqueue INPUT_PATH and generate it in this process against --server URLs until done."""
    counts = run_pipeline(input_path, run_name, tokenizer_path, list(servers), opts)
    if as_json:
        print_json(counts.to_json())


def run_pipeline(
    input_path: Path, run_name: str, tokenizer_path: str, servers: list[str], opts: dict[str, Any]
) -> reads.RunCounts:
    from app.prompts.inputs import check_input

    check_input(input_path)  # at once: before the heavy imports and the servers' context length
    from rich.markup import escape

    from app.ledger import run_queries
    from ops.views import run_progress
    from ops.views.progress import Progress
    from workers.engine.runner import EmbeddedRunner

    console = err_console()
    settings = get_settings()
    db = open_db(settings)
    again = "tokenmill " + shlex.join(sys.argv[1:])
    # the servers' own context length wins over the tokenizer folder's (named if they differ)
    opts = {**opts, "server_contexts": server_contexts(settings, servers)}
    try:
        # the run is this process's: the fleet's reconcile and workers leave it alone
        enqueue_input(
            input_path, run_name, tokenizer_path, False, opts, driver=run_queries.DRIVER_RUN
        )
    except KeyboardInterrupt:
        _say_continue(f"interrupted: what was enqueued is kept. {CONTINUE}", again)
        raise SystemExit(130) from None
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)

    def notice(message: str) -> None:
        console.print(f"[yellow]{escape(message)}[/yellow]", markup=True, soft_wrap=True)

    runner = EmbeddedRunner(db, settings, run, servers, on_notice=notice)
    pace = run_progress.Pace()
    started = pace.started
    try:
        with Progress(console) as progress:
            draw = run_progress.frame if progress.terminal else run_progress.log_lines

            def tick(counts: reads.RunCounts) -> None:
                progress.show(draw(counts, runner.servers(), pace))

            runner.start()
            counts = runner.wait(on_tick=tick)
            if not progress.terminal:  # the last picture, once, as a table
                for line in run_progress.table(counts, runner.servers(), pace):
                    progress.say(line)
    except KeyboardInterrupt:
        _stop_interrupted(runner, settings, again)
        raise SystemExit(130) from None
    except BaseException:
        runner.stop()
        raise
    runner.stop()
    console.print(
        f"run [bold]{escape(run_name)}[/bold] finished in {time.monotonic() - started:.1f}s: "
        f"{counts.done} done ({counts.truncated} truncated), {counts.failed} failed, "
        f"{counts.output_tokens} output tokens",
        markup=True,
    )
    return counts


CONTINUE = "To continue the run:"
DRAIN_LINE_EVERY_S = 5  # in a pipe, the drain after Ctrl-C counts down this often


def _say_continue(message: str, again: str) -> None:
    """A message, then the command that continues on a line of its own (to copy whole)."""
    console = err_console()
    console.print(message, markup=False, highlight=False, soft_wrap=True)
    console.print(again, markup=False, highlight=False, soft_wrap=True)
    console.file.flush()


def server_contexts(settings: Settings, servers: list[str]) -> dict[str, int | None]:
    """Each --server's context length from its /server_info, by the name the run gives it."""
    from workers.engine.identity import server_name_for
    from workers.engine.server_limits import server_contexts as read_contexts

    return read_contexts(settings, {server_name_for(url.rstrip("/")): url for url in servers})


def interrupted_line(inflight: int, drain_timeout_s: float) -> str:
    """What the first Ctrl-C says it waits for (nothing in flight: that it stops at once)."""
    if inflight == 0:
        return f"interrupted: nothing in flight, stopping. {CONTINUE}"
    requests = counted(inflight, "request")
    return (
        f"interrupted: waiting up to {drain_timeout_s:.0f}s for the {requests} in flight to "
        f"finish (their results are kept); Ctrl-C again to stop now. {CONTINUE}"
    )


def _stop_interrupted(runner: EmbeddedRunner, settings: Settings, again: str) -> None:
    """Ctrl-C: say at once what the stop waits for and how to go on, then count the drain
    down; a second Ctrl-C stops at once (what was in flight stays leased to this dead process,
    and the rerun takes it back as it starts)."""
    import threading

    from ops.views.progress import Line, Progress

    console = err_console()
    _say_continue(interrupted_line(runner.inflight(), settings.drain_timeout_s), again)

    def stop_now(signum: int, frame: object) -> None:
        _say_continue(
            f"stopped now; the {counted(runner.inflight(), 'request')} that were in flight go "
            f"back to the queue when the run continues. {CONTINUE}",
            again,
        )
        os._exit(130)  # now, without waiting for the threads still draining

    signal.signal(signal.SIGINT, stop_now)
    stopping = threading.Thread(target=runner.stop, name="tm-run-stop", daemon=True)
    deadline = time.monotonic() + settings.drain_timeout_s
    stopping.start()
    with Progress(console) as progress:
        while stopping.is_alive():
            left_s = max(0.0, deadline - time.monotonic())
            inflight = runner.inflight()
            text = f"draining: {counted(inflight, 'request')} in flight, {left_s:.0f}s left"
            progress.show([Line("drain", text, (inflight, int(left_s // DRAIN_LINE_EVERY_S)))])
            stopping.join(0.25)
    counts = runner.counts()
    _say_continue(
        f"stopped: {counts.done + counts.failed} of {counts.total} items finished. {CONTINUE}",
        again,
    )
