"""The speculative-decoding parts of `tokenmill report`: the acceptance section of a run's page
(tables and plots) and the page comparing two runs pair by pair (`report A --compare B`)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from app.outputs.accept_pairs import PAIRED_HEADER, paired_cells
from app.outputs.acceptance import LENGTH_FIELD, STATS_HEADER, stats_cells

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from app.ledger import run_queries
    from app.outputs.accept_pairs import PairedReport
    from app.outputs.acceptance import AcceptReport

ACCEPT_FIGURES = (
    (
        "acceptance_by_group.png",
        "Acceptance length by group",
        "Tokens committed per verify step (Σ completion tokens / Σ verify steps, SGLang's "
        "spec_accept_length over the group) with its 95% bootstrap interval; the dashed line "
        "is the run's overall value. Groups far below it are where the draft needs data.",
    ),
    (
        "acceptance_histogram.png",
        "Accepted drafts per verify step",
        "SGLang's spec_correct_drafts_histogram summed over the run: how many verify steps "
        "accepted 0, 1, 2, ... draft tokens. Mass at 0 is wasted drafting.",
    ),
    (
        "acceptance_vs_length.png",
        "Acceptance against output length",
        "Acceptance length per output-length bucket, token-weighted (with its interval) and as "
        "the mean of the requests' own values.",
    ),
)


def acceptance_report_for(db: Engine, run: run_queries.RunInfo) -> AcceptReport | None:
    """The acceptance of a run whose results carry speculative counters, else None."""
    from app.ledger import spec_stats
    from app.outputs.accept_rows import load_rows, speculative_of
    from app.outputs.acceptance import accept_report, default_fields

    with db.connect() as conn:
        if not spec_stats.run_has_spec_stats(conn, run.id):
            return None
    rows = load_rows(db, run)
    return accept_report(
        run.name, speculative_of(run), rows, default_fields(rows, run.generation.turns)
    )


def _group_field(report: AcceptReport) -> str:
    """The field the per-group plot shows: category if asked, else the first one asked."""
    for name in report.by:
        if name != LENGTH_FIELD:
            return name
    return LENGTH_FIELD


def draw_acceptance(report: AcceptReport, out_dir: Path) -> list[Path]:
    from ops.views import report_accept_plots as plots

    assert report.overall is not None
    field = _group_field(report)
    return [
        plots.acceptance_by_group(
            report.by.get(field, []), report.overall, field, out_dir / ACCEPT_FIGURES[0][0]
        ),
        plots.accepted_histogram(report.overall, out_dir / ACCEPT_FIGURES[1][0]),
        plots.acceptance_vs_length(report.by.get(LENGTH_FIELD, []), out_dir / ACCEPT_FIGURES[2][0]),
    ]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{escape(cell)}</td>" if i == 0 else f'<td class="n">{escape(cell)}</td>'
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def acceptance_section(report: AcceptReport) -> str:
    """The run page's "Speculative decoding" section: settings, tables, figures."""
    assert report.overall is not None
    groups = [report.overall, *(g for gs in report.by.values() for g in gs)]
    figures = "".join(
        f'<h3>{escape(title)}</h3><figure><img src="{escape(name)}" alt="{escape(title)}">'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
        for name, title, caption in ACCEPT_FIGURES
    )
    return (
        "<h2>Speculative decoding</h2>"
        f"<p>Draft settings pinned by the run: <code>{escape(str(report.speculative))}</code>. "
        f"{report.done:,} done requests, {report.without_stats:,} without counters; 95% "
        f"bootstrap intervals ({report.resamples} resamples, seed {report.seed}). "
        "<code>tokenmill accept RUN</code> prints the same numbers.</p>"
        f"{_table(STATS_HEADER, [stats_cells(g) for g in groups])}{figures}"
    )


def compare_page(report: PairedReport, images: Sequence[str], style: str) -> str:
    outputs = report.outputs
    if outputs.red_flag:
        flag = (
            f'<p class="warn">RED FLAG: {outputs.differing:,} of {outputs.compared:,} pairs '
            "have different output ids under greedy sampling; speculative decoding is lossless, "
            f"so the targets, templates or servers differ. E.g. {escape(str(outputs.examples))}"
            "</p>"
        )
    else:
        flag = (
            f'<p class="ok">Outputs: {outputs.differing:,} of {outputs.compared:,} pairs differ '
            f"({'greedy: none may' if outputs.greedy else 'sampled: differences expected'}).</p>"
        )
    better = report.better or "unclear (the interval of B - A contains 0)"
    worse = report.worse_groups()
    groups = [g for g in ([report.overall] if report.overall else [])] + [
        g for gs in report.by.values() for g in gs
    ]
    figures = "".join(
        f'<figure><img src="{escape(name)}" alt="{escape(name)}"></figure>' for name in images
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>tokenmill: {escape(report.run_a)} vs {escape(report.run_b)}</title>"
        f"<style>{style}</style></head><body>"
        f"<h1>{escape(report.run_a)} (A) vs {escape(report.run_b)} (B)</h1>"
        f"<p>A: <code>{escape(str(report.speculative_a))}</code><br>"
        f"B: <code>{escape(str(report.speculative_b))}</code></p>"
        f"<p>Matched by (key, sample, turn): {outputs.compared:,} pairs; {report.only_a:,} only "
        f"in A, {report.only_b:,} only in B.</p>{flag}"
        f"<h2>Better draft overall: {escape(better)}</h2>"
        + (
            "<p>B is worse in: " + escape(", ".join(f"{g.field}={g.value}" for g in worse)) + "</p>"
            if worse
            else "<p>No group is worse under B.</p>"
        )
        + f"{_table(PAIRED_HEADER, [paired_cells(g) for g in groups])}{figures}</body></html>\n"
    )


def build_compare_report(db: Engine, run_a: str, run_b: str, out_dir: Path, style: str) -> Path:
    """`tokenmill report A --compare B --out DIR`: DIR/index.html (styled like the run
    report) and its plots."""
    from app.ledger import run_queries
    from app.outputs.accept_pairs import Side, paired_report
    from app.outputs.accept_rows import is_greedy, load_rows, speculative_of
    from app.outputs.acceptance import default_fields
    from ops.views import report_accept_plots as plots

    with db.connect() as conn:
        a = run_queries.get_run(conn, run_a)
        b = run_queries.get_run(conn, run_b)
    rows_a = load_rows(db, a)
    report = paired_report(
        Side(a.name, speculative_of(a), rows_a),
        Side(b.name, speculative_of(b), load_rows(db, b)),
        default_fields(rows_a, a.generation.turns),
        greedy=is_greedy(a) and is_greedy(b),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    images = []
    for name, groups in report.by.items():
        image = f"paired_{name}.png"
        title = f"Acceptance length B - A by {name}"
        plots.paired_differences(groups, title, out_dir / image)
        images.append(image)
    index = out_dir / "index.html"
    tmp = index.with_suffix(".html.tmp")
    tmp.write_text(compare_page(report, images, style), encoding="utf-8")
    tmp.replace(index)
    return index
