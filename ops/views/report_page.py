"""The page of `tokenmill report RUN --out DIR`: one HTML page with PNG plots to judge a run's data.

Items are streamed a page at a time into fixed-size accumulators; plots are drawn from those.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from app.ledger import reads, run_queries
    from app.outputs.report_stats import PausePeriod, ReportData

TRUNCATION_WARN = 0.05
FAILURE_WARN = 0.01
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1060px; color: #222;
       padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 3px 10px; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.warn { background: #fff4e5; border-left: 4px solid #dd8452; padding: 0.4em 0.8em;
        margin: 0.3em 0; }
.ok { background: #eef7ee; border-left: 4px solid #2ca02c; padding: 0.4em 0.8em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.92em; }
code { background: #f4f4f4; padding: 0 3px; }
"""
FIGURES = (
    (
        "output_lengths.png",
        "Output length",
        "Samples by output length on a log scale; the dashed line is max_new_tokens and "
        "truncated samples (finish_reason length) are stacked in orange. A tall orange bar "
        "means many answers were cut off: raise max_new_tokens or drop them before training.",
    ),
    (
        "finish_reasons.png",
        "Finish reasons",
        "How each item ended. 'stop' is a natural end; 'length' hit max_new_tokens; "
        "'failed' items have no sample (see the failure reasons below).",
    ),
    (
        "throughput.png",
        "Throughput over time",
        "Output tokens per second per server; hatched spans are periods a server that served "
        "this run was paused while it served it (paused / resumed events; servers that never "
        "took an item of the run are not shown). Dips outside a pause point at a slow or "
        "stuck server.",
    ),
    (
        "latency.png",
        "Latency",
        "End-to-end latency per sample, per server. A server whose curve sits far to the "
        "right of the others is slower.",
    ),
    (
        "prompt_vs_output.png",
        "Prompt vs output length",
        "Each dot is a sample; orange dots were truncated. Outputs stuck at a tiny length "
        "for many prompts are worth a look.",
    ),
)


@dataclass(frozen=True)
class ReportResult:
    index: Path
    images: list[Path]
    items: int


def build_report(db: Engine, run_name: str, out_dir: Path) -> ReportResult:
    """Stream the run's finished items once, draw the figures, write out_dir/index.html."""
    from app.core.constants import EVENT_PAUSED, EVENT_RESUMED
    from app.ledger import common, dashboard_queries, reads, run_queries
    from app.outputs.report_stats import accumulate, pause_periods, serving_pauses
    from ops.views import report_plots  # matplotlib loads only when a report is made
    from ops.views.report_accept import acceptance_report_for, acceptance_section, draw_acceptance

    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        counts = reads.run_counts(conn, run)
        ranges = dashboard_queries.item_ranges(conn, run.id)
        data = accumulate(
            dashboard_queries.iter_item_stats(conn, run.id),
            ranges,
            max_new_tokens=run.generation.sampling.max_new_tokens,
        )
        failures = dashboard_queries.failure_reasons(conn, run.id)
        pauses: list[PausePeriod] = []
        if data.throughput is not None:
            tp = data.throughput
            pauses = pause_periods(
                dashboard_queries.server_events(
                    conn, kinds=(EVENT_PAUSED, EVENT_RESUMED), since=tp.start, until=tp.end
                ),
                paused_kind=EVENT_PAUSED,
                resumed_kind=EVENT_RESUMED,
                since=tp.start,
                until=tp.end,
            )
    # a server that never served the run is no part of its story; the plot shades a pause
    # only while the server served the run, the table lists its whole pause
    pauses = [p for p in pauses if p.server in data.servers]
    out_dir.mkdir(parents=True, exist_ok=True)
    colors = report_plots.server_colors(sorted(data.servers))
    images = [
        report_plots.output_lengths(data, out_dir / FIGURES[0][0]),
        report_plots.finish_reasons(data, out_dir / FIGURES[1][0]),
        report_plots.throughput(
            data, serving_pauses(pauses, data.servers), colors, out_dir / FIGURES[2][0]
        ),
        report_plots.latency(data, colors, out_dir / FIGURES[3][0]),
        report_plots.prompt_vs_output(data, out_dir / FIGURES[4][0]),
    ]
    accept = acceptance_report_for(db, run)
    extra = ""
    if accept is not None and accept.overall is not None:
        images += draw_acceptance(accept, out_dir)
        extra = acceptance_section(accept)
    index = out_dir / "index.html"
    page = render_page(
        run, counts, data, failures, pauses, generated_at=common.utcnow(), extra_sections=extra
    )
    tmp = index.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(index)
    return ReportResult(index=index, images=images, items=data.done + data.failed)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "—"


def _rows(rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{v:,}</td>' if isinstance(v, int) else f"<td>{escape(str(v))}</td>"
            for v in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def warnings_for(counts: reads.RunCounts, data: ReportData) -> list[str]:
    """Plain-language flags a person should read before training on this run."""
    found: list[str] = []
    unfinished = counts.pending + counts.queued + counts.leased
    if unfinished:
        found.append(f"The run is not finished: {unfinished:,} of {counts.total:,} items remain.")
    if data.done and data.truncated / data.done > TRUNCATION_WARN:
        found.append(
            f"{_pct(data.truncated, data.done)} of samples were truncated at max_new_tokens "
            f"= {data.max_new_tokens:,} (more than {TRUNCATION_WARN:.0%})."
        )
    finished = data.done + data.failed
    if finished and data.failed / finished > FAILURE_WARN:
        found.append(
            f"{_pct(data.failed, finished)} of finished items failed "
            f"(more than {FAILURE_WARN:.0%}); see the failure reasons."
        )
    if data.empty_outputs:
        found.append(f"{data.empty_outputs:,} samples have an empty output.")
    return found


def _tokenizer_files(run: run_queries.RunInfo) -> str:
    if run.generation.tokenizer_files is None:
        return "not recorded (run older than the per-file manifest)"
    return ", ".join(
        f"{name} ({digest[:8]})" for name, digest in sorted(run.generation.tokenizer_files.items())
    )


def _length(value: float | None, approx: bool) -> str:
    return "—" if value is None else ("≈" if approx else "") + f"{value:,.0f}"


def render_page(
    run: run_queries.RunInfo,
    counts: reads.RunCounts,
    data: ReportData,
    failures: list[tuple[str, int]],
    pauses: list[PausePeriod],
    *,
    generated_at: datetime,
    extra_sections: str = "",
) -> str:
    """The run's page; extra_sections (HTML, e.g. the speculative-decoding section) go after
    the figures."""
    flags = warnings_for(counts, data)
    verdict = (
        "".join(f'<p class="warn">{escape(w)}</p>' for w in flags)
        if flags
        else '<p class="ok">Finished; no truncation, failure or empty-output warnings.</p>'
    )
    approx = data.scatter.sampled
    mean = data.output_tokens / data.done if data.done else None
    summary = _rows(
        [
            ("items", counts.total),
            ("done", counts.done),
            (
                "truncated (of done)",
                f"{counts.truncated:,} ({_pct(counts.truncated, counts.done)})",
            ),
            ("failed", f"{counts.failed:,} ({_pct(counts.failed, counts.total)})"),
            ("pending / queued / leased", f"{counts.pending} / {counts.queued} / {counts.leased}"),
            ("prompt tokens", counts.prompt_tokens),
            ("output tokens", counts.output_tokens),
            ("output length mean", _length(mean, False)),
            (
                "output length p50 / p90 / p99",
                " / ".join(_length(data.output_percentile(p), approx) for p in (50, 90, 99)),
            ),
            ("output length max", data.max_output_tokens),
        ],
        ("", "value"),
    )
    config = _rows(
        [
            ("created", f"{run.created_at:%Y-%m-%d %H:%M:%S} UTC"),
            (
                "tokenizer",
                f"{run.generation.tokenizer_path} (hash {run.generation.tokenizer_hash[:12]})",
            ),
            ("tokenizer files", _tokenizer_files(run)),
            (
                "tokenizer code",
                "the folder's own code (--trust-remote-code, pinned)"
                if run.generation.trust_remote_code
                else "transformers only",
            ),
            ("chat template hash", run.generation.chat_template_hash[:12]),
            (
                "chat template kwargs",
                json.dumps(run.generation.chat_template_kwargs, sort_keys=True),
            ),
            ("sampling", json.dumps(run.generation.sampling.to_json(), sort_keys=True)),
            ("samples per prompt", str(run.generation.samples_per_prompt)),
            ("server fingerprint", json.dumps(run.fingerprint, sort_keys=True)),
        ],
        ("setting", "value"),
    )
    servers = _rows(
        [
            (
                name,
                t.done,
                t.truncated,
                t.failed,
                t.output_tokens,
                "—" if t.mean_latency_s is None else f"{t.mean_latency_s:.2f}",
            )
            for name, t in sorted(data.servers.items())
        ],
        ("server", "done", "truncated", "failed", "output tokens", "mean latency (s)"),
    )
    pause_table = (
        _rows(
            [
                (
                    p.server,
                    f"{p.paused_at:%Y-%m-%d %H:%M:%S}",
                    "still paused" if p.open else f"{p.end:%Y-%m-%d %H:%M:%S}",
                    f"{(p.end - p.start).total_seconds():,.0f}",
                )
                for p in pauses
            ],
            ("server", "paused at (UTC)", "resumed at (UTC)", "seconds while the run worked"),
        )
        if pauses
        else "<p>No server was paused while this run was working.</p>"
    )
    failure_table = (
        _rows(failures, ("error (first 160 characters)", "items"))
        if failures
        else "<p>No failed items.</p>"
    )
    figures = "".join(
        f'<h2>{escape(title)}</h2><figure><img src="{escape(name)}" alt="{escape(title)}">'
        f"<figcaption>{escape(caption)}</figcaption></figure>"
        for name, title, caption in FIGURES
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>tokenmill report: {escape(run.name)}</title><style>{STYLE}</style></head><body>"
        f"<h1>Run {escape(run.name)}</h1>"
        f"<p>Report generated {generated_at:%Y-%m-%d %H:%M:%S} UTC by "
        "<code>tokenmill report</code>.</p>"
        f"{verdict}<h2>Summary</h2>{summary}{figures}{extra_sections}"
        f"<h2>Servers</h2>{servers}<h2>Pauses</h2>{pause_table}"
        f"<h2>Failure reasons</h2>{failure_table}<h2>Run settings</h2>{config}"
        "</body></html>\n"
    )
