"""`tokenmill report RUN --out DIR`: the command that writes a run's HTML page
(ops.views.report_page) or, with --compare, the page comparing two drafts
(ops.views.report_accept)."""

from __future__ import annotations

from pathlib import Path

import click

from ops.options import err_console, handle_errors, open_db


@click.command("report")
@click.argument("run_name")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="Folder for index.html and its PNG plots (created if missing).",
)
@click.option(
    "--compare",
    "run_b",
    default=None,
    metavar="RUN_B",
    help="Instead: the page comparing two drafts (RUN_NAME = A, RUN_B = B) pair by pair, as "
    "`tokenmill accept RUN_NAME RUN_B` does.",
)
@handle_errors
def report_cmd(run_name: str, out_dir: Path, run_b: str | None) -> None:
    """Write an HTML report of RUN_NAME (lengths, finish reasons, throughput, latency, and the
    draft's acceptance when the servers speculated) to --out."""
    if run_b is not None:
        from ops.views.report_accept import build_compare_report
        from ops.views.report_page import STYLE

        index = build_compare_report(open_db(), run_name, run_b, out_dir, STYLE)
        err_console().print(f"wrote {index}", highlight=False, markup=False, soft_wrap=True)
        return
    from ops.views.report_page import build_report

    result = build_report(open_db(), run_name, out_dir)
    err_console().print(
        f"wrote {result.index} ({len(result.images)} plots, {result.items:,} finished items)",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
