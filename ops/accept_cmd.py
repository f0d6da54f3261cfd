"""`tokenmill accept RUN [RUN_B]`: a draft's acceptance from a run's stored speculative counters,
per group with bootstrap intervals, or two runs compared pair by pair; tables or --json.

`app.outputs.accept_rows` reads the rows with their counters; `app.outputs.acceptance` and
`app.outputs.accept_pairs` compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from ops.options import handle_errors, open_db, print_json

if TYPE_CHECKING:
    from app.outputs.accept_pairs import PairedGroup, PairedReport
    from app.outputs.acceptance import AcceptReport, GroupStats


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A titled table whose values are never cut (ops.views.text_table): the first column left, the
    figures right."""
    from ops.views.text_table import Column, render

    columns = [Column(name, right=index > 0) for index, name in enumerate(header)]
    lines, _ = render(columns, rows)
    click.echo("\n".join([title, *lines, ""]))


def _stats_table(title: str, groups: Sequence[GroupStats]) -> None:
    from app.outputs.acceptance import STATS_HEADER, stats_cells

    print_table(title, STATS_HEADER, [stats_cells(g) for g in groups])


def print_accept(report: AcceptReport) -> None:
    from ops.options import out_console

    out = out_console()
    settings = report.speculative or "none pinned (the servers did not speculate)"
    out.print(f"run {report.run}: speculative settings {settings}")
    out.print(
        f"{report.done} done requests, {report.without_stats} without speculative counters; "
        f"95% bootstrap intervals ({report.resamples} resamples, seed {report.seed})"
    )
    if report.overall is None:
        out.print("no request has speculative counters: nothing to measure")
        return
    _stats_table("overall", [report.overall])
    for name, groups in report.by.items():
        _stats_table(f"by {name}", groups)


def _paired_table(title: str, groups: Sequence[PairedGroup]) -> None:
    from app.outputs.accept_pairs import PAIRED_HEADER, paired_cells

    print_table(title, PAIRED_HEADER, [paired_cells(g) for g in groups])


def print_paired(report: PairedReport) -> None:
    from ops.options import out_console

    out = out_console()
    out.print(f"A = {report.run_a}: {report.speculative_a}")
    out.print(f"B = {report.run_b}: {report.speculative_b}")
    out.print(
        f"matched by (key, sample, turn): {report.outputs.compared} pairs; "
        f"{report.only_a} only in A, {report.only_b} only in B, "
        f"{report.without_stats} pairs without speculative counters"
    )
    outputs = report.outputs
    if outputs.red_flag:
        out.print(
            f"[bold red]RED FLAG[/bold red]: {outputs.differing} of {outputs.compared} pairs "
            "have different output ids under greedy sampling (speculative decoding is "
            f"lossless: the targets, templates or servers differ); e.g. {outputs.examples}"
        )
    elif outputs.greedy:
        out.print(f"outputs: all {outputs.compared} pairs identical (greedy: as expected)")
    else:
        out.print(
            f"outputs: {outputs.differing} of {outputs.compared} pairs differ (sampled, not "
            "greedy: expected)"
        )
    if report.overall is None:
        out.print("no pair has speculative counters on both sides: nothing to compare")
        return
    better = report.better
    out.print(
        f"better draft overall: {better}"
        if better
        else "better draft overall: unclear (the interval of B - A contains 0)"
    )
    _paired_table("acceptance length, overall", [report.overall])
    for name, groups in report.by.items():
        _paired_table(f"acceptance length by {name}", groups)
    worse = report.worse_groups()
    if worse:
        out.print("B is worse in: " + ", ".join(f"{g.field}={g.value}" for g in worse))
    else:
        out.print("no group is worse under B")


@click.command("accept")
@click.argument("run_name")
@click.argument("run_b", required=False)
@click.option(
    "--by",
    "fields",
    multiple=True,
    metavar="FIELD",
    show_default="category and source when present, turn for --turns each runs, output_length",
    help="Group by this row field (repeatable): category, source, any metadata field (a.b "
    "reads field b inside object field a), 'turn', 'output_length'.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Bootstrap seed.")
@click.option(
    "--resamples",
    type=click.IntRange(min=100),
    default=1000,
    show_default=True,
    help="Bootstrap resamples per interval.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def accept_cmd(
    run_name: str,
    run_b: str | None,
    fields: tuple[str, ...],
    seed: int,
    resamples: int,
    as_json: bool,
) -> None:
    """Acceptance length and rate of RUN_NAME's draft, per group, with 95% intervals.

    With RUN_B: the two runs paired by (key, sample, turn), B minus A per group, the groups
    where B is worse, and whether their outputs differ (a red flag under greedy sampling).
    """
    from app.ledger import run_queries
    from app.outputs.accept_pairs import Side, paired_report
    from app.outputs.accept_rows import is_greedy, load_rows, speculative_of
    from app.outputs.acceptance import accept_report, default_fields

    db = open_db()
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        other = run_queries.get_run(conn, run_b) if run_b else None
    rows = load_rows(db, run)
    chosen = list(fields) or default_fields(rows, run.generation.turns)
    if other is None:
        report = accept_report(
            run.name, speculative_of(run), rows, chosen, seed=seed, resamples=resamples
        )
        if as_json:
            print_json(report.to_json())
        else:
            print_accept(report)
        return
    paired = paired_report(
        Side(run.name, speculative_of(run), rows),
        Side(other.name, speculative_of(other), load_rows(db, other)),
        chosen,
        greedy=is_greedy(run) and is_greedy(other),
        seed=seed,
        resamples=resamples,
    )
    if as_json:
        print_json(paired.to_json())
    else:
        print_paired(paired)
