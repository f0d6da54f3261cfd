"""`tokenmill run`: enqueue, then generate in this process against `--server` URLs until the
run is done, with a live view of each server (ok, down for how long, why) and a Ctrl-C that
says what it waits for.
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
    err_console,
    field_option,
    get_settings,
    handle_errors,
    open_db,
    print_json,
    render_options,
    sampling_options,
)
from ops.pipeline_cmd import enqueue_input

if TYPE_CHECKING:
    from rich.table import Table

    from app.core.settings import Settings
    from app.ledger.reads import RunCounts
    from workers.engine.runner import EmbeddedRunner


def _progress_table(counts: RunCounts, runner: EmbeddedRunner, started: float) -> Table:
    from rich.markup import escape
    from rich.table import Table

    elapsed = max(time.monotonic() - started, 1e-6)
    finished = counts.done + counts.failed
    rate = counts.output_tokens / elapsed
    items_rate = finished / elapsed
    eta = (counts.total - finished) / items_rate if items_rate > 0 else float("nan")
    table = Table.grid(padding=(0, 2))
    width = 30
    filled = int(width * finished / counts.total) if counts.total else width
    bar = "█" * filled + "░" * (width - filled)
    table.add_row(
        f"[bold]{escape(counts.run)}[/bold]",
        bar,
        f"{finished}/{counts.total}",
        f"done {counts.done}",
        f"failed {counts.failed}",
        f"truncated {counts.truncated}",
        f"{rate:,.0f} tok/s",
        f"ETA {eta:,.0f}s" if eta == eta else "ETA —",
    )
    for view in runner.servers():
        if view.drift:
            state = "[red]token drift: no work[/red]"
        elif view.refused:
            state = "[red]fingerprint differs: no work[/red]"
        elif view.auth:
            state = "[red]needs an API key: no work[/red]"
        elif view.draining:
            state = "[yellow]draining: no new work[/yellow]"
        elif view.down and view.down_for_s is not None:
            state = f"[red]down {view.down_for_s:,.0f}s[/red]"
        elif view.down:
            state = "[yellow]connecting[/yellow]"
        elif view.unavailable:
            state = "[red]unavailable[/red]"
        else:
            state = "[green]ok[/green]"
        if view.parity_differs:
            state += " [yellow]renders prompts differently[/yellow]"
        error = view.drift or (view.down_error if view.down else view.last_error)
        err = f"last error: {escape(error[:80])}" if error else ""
        table.add_row(
            f"  {escape(view.name)}",
            state,
            f"in flight {view.inflight}",
            f"done {view.done}",
            f"failed {view.failed}",
            "",
            "",
            err,
        )
    return table


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
) -> RunCounts:
    from rich.live import Live
    from rich.markup import escape

    from app.ledger import run_queries
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
        console.print(
            f"interrupted: what was enqueued is kept; `{escape(again)}` continues", soft_wrap=True
        )
        raise SystemExit(130) from None
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)

    def notice(message: str) -> None:
        console.print(f"[yellow]{escape(message)}[/yellow]", markup=True, soft_wrap=True)

    runner = EmbeddedRunner(db, settings, run, servers, on_notice=notice)
    started = time.monotonic()
    try:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            runner.start()
            counts = runner.wait(on_tick=lambda c: live.update(_progress_table(c, runner, started)))
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


def server_contexts(settings: Settings, servers: list[str]) -> dict[str, int | None]:
    """Each --server's context length from its /server_info, by the name the run gives it."""
    from workers.engine.identity import server_name_for
    from workers.engine.server_limits import server_contexts as read_contexts

    return read_contexts(settings, {server_name_for(url.rstrip("/")): url for url in servers})


def _stop_interrupted(runner: EmbeddedRunner, settings: Settings, again: str) -> None:
    """Ctrl-C: say at once what the stop waits for and how to go on; a second Ctrl-C stops
    at once (what was in flight stays leased to this dead process, and the rerun takes it
    back as it starts)."""
    from rich.markup import escape

    console = err_console()
    inflight = runner.inflight()
    console.print(
        f"[yellow]interrupted:[/yellow] waiting up to {settings.drain_timeout_s:.0f}s for the "
        f"{inflight} requests in flight to finish (their results are kept); Ctrl-C again to "
        f"stop now. `{escape(again)}` continues the run.",
        markup=True,
        soft_wrap=True,
    )

    def stop_now(signum: int, frame: object) -> None:
        console.print(
            f"stopped now; the {runner.inflight()} requests that were in flight go back to "
            f"the queue when `{again}` starts",
            markup=False,
            soft_wrap=True,
        )
        console.file.flush()
        os._exit(130)  # now, without waiting for the threads still draining

    signal.signal(signal.SIGINT, stop_now)
    runner.stop()
    counts = runner.counts()
    console.print(
        f"stopped: {counts.done + counts.failed} of {counts.total} items finished; "
        f"`{again}` continues the run",
        markup=False,
        soft_wrap=True,
    )
