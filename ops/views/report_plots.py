"""The figures of `tokenmill report`, drawn with matplotlib's Agg canvas into PNG files.

Each takes accumulated `ReportData` (never items), so drawing costs the same for any run size.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from app.outputs.report_stats import FAILED, Histogram, PausePeriod, ReportData, Throughput

STOP_COLOR = "#4C72B0"
TRUNCATED_COLOR = "#DD8452"
FAILED_COLOR = "#C44E52"
SERVER_COLORS = (
    "#1f77b4",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#ff7f0e",
    "#d62728",
)
DPI = 100
SIZE_IN = (10.0, 4.2)


def _figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: no display, no global pyplot state
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=13)
    ax.set_xticks([])
    ax.set_yticks([])


def server_colors(names: list[str]) -> dict[str, str]:
    return {name: SERVER_COLORS[i % len(SERVER_COLORS)] for i, name in enumerate(sorted(names))}


def _bars(ax: Axes, hist: Histogram, *, bottom: list[int] | None, color: str, label: str) -> None:
    lefts = hist.edges[:-1]
    widths = [b - a for a, b in zip(hist.edges[:-1], hist.edges[1:], strict=True)]
    ax.bar(
        lefts,
        hist.counts,
        width=widths,
        bottom=bottom or 0,
        align="edge",
        color=color,
        label=label,
        edgecolor="white",
        linewidth=0.3,
    )


def output_lengths(data: ReportData, path: Path) -> Path:
    fig, ax = _figure()
    if data.done == 0:
        _empty(ax, "no finished samples yet")
        return _save(fig, path)
    _bars(ax, data.stop_lengths, bottom=None, color=STOP_COLOR, label="stopped on its own")
    _bars(
        ax,
        data.truncated_lengths,
        bottom=data.stop_lengths.counts,
        color=TRUNCATED_COLOR,
        label=f"truncated (finish_reason length): {data.truncated}",
    )
    ax.axvline(data.max_new_tokens, color=TRUNCATED_COLOR, linestyle="--", linewidth=1.2)
    share = 100 * data.truncated / data.done
    ax.annotate(
        f"max_new_tokens = {data.max_new_tokens:,}\n{data.truncated:,} truncated ({share:.1f}%)",
        xy=(data.max_new_tokens, 0.97),
        xycoords=("data", "axes fraction"),
        xytext=(-28, 0),
        textcoords="offset points",
        ha="right",
        va="top",
        color=TRUNCATED_COLOR,
        fontsize=10,
        bbox={"facecolor": "white", "alpha": 0.9, "edgecolor": "none"},
    )
    ax.set_xscale("log")
    filled = [
        i
        for i, (a, b) in enumerate(
            zip(data.stop_lengths.counts, data.truncated_lengths.counts, strict=True)
        )
        if a or b
    ]
    edges = data.stop_lengths.edges
    ax.set_xlim(edges[filled[0]] / 1.2, max(edges[-1], data.max_new_tokens) * 1.2)
    ax.set_xlabel("output length (tokens, log scale)")
    ax.set_ylabel("samples")
    ax.set_title("Output length")
    ax.legend(loc="upper left", frameon=False)
    return _save(fig, path)


def finish_reasons(data: ReportData, path: Path) -> Path:
    fig, ax = _figure()
    if not data.finish_reasons:
        _empty(ax, "no finished items yet")
        return _save(fig, path)
    reasons = sorted(data.finish_reasons, key=lambda r: (r == FAILED, -data.finish_reasons[r]))
    counts = [data.finish_reasons[r] for r in reasons]
    colors = [
        FAILED_COLOR if r == FAILED else TRUNCATED_COLOR if r == "length" else STOP_COLOR
        for r in reasons
    ]
    bars = ax.barh(reasons, counts, color=colors)
    total = sum(counts)
    ax.bar_label(bars, labels=[f"{c:,} ({100 * c / total:.1f}%)" for c in counts], padding=4)
    ax.invert_yaxis()
    ax.set_xlim(0, max(counts) * 1.25)
    ax.set_xlabel("items")
    ax.set_title("Finish reasons (failed = no sample)")
    return _save(fig, path)


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s < 300:
        return 1.0, "seconds"
    if span_s < 5 * 3600:
        return 60.0, "minutes"
    return 3600.0, "hours"


def _offset(at: datetime, start: datetime, unit_s: float) -> float:
    return (at - start).total_seconds() / unit_s


def throughput(
    data: ReportData, pauses: list[PausePeriod], colors: dict[str, str], path: Path
) -> Path:
    fig, ax = _figure()
    tp: Throughput | None = data.throughput
    if tp is None or not tp.tokens:
        _empty(ax, "no finished samples yet")
        return _save(fig, path)
    unit_s, unit = _time_unit(tp.span_s)
    xs = [edge / unit_s for edge in tp.edges_s()]
    for server in sorted(tp.tokens):
        rates = tp.tokens_per_s(server)
        ax.stairs(
            rates, xs, baseline=None, color=colors.get(server, "black"), linewidth=1.6, label=server
        )
    shaded: set[str] = set()
    for p in pauses:
        label = None if p.server in shaded else f"{p.server} paused"
        shaded.add(p.server)
        ax.axvspan(
            _offset(p.start, tp.start, unit_s),
            _offset(p.end, tp.start, unit_s),
            color=colors.get(p.server, "grey"),
            alpha=0.15,
            hatch="//",
            label=label,
        )
    ax.set_xlim(0, xs[-1])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"{unit} since {tp.start:%Y-%m-%d %H:%M:%S} UTC (bins of {tp.width_s:g} s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput per server (shaded: server paused)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return _save(fig, path)


def latency(data: ReportData, colors: dict[str, str], path: Path) -> Path:
    fig, ax = _figure()
    if not data.latency:
        _empty(ax, "no latencies recorded yet")
        return _save(fig, path)
    for server in sorted(data.latency):
        hist = data.latency[server]
        ax.stairs(
            hist.counts,
            hist.edges,
            color=colors.get(server, "black"),
            linewidth=1.6,
            label=f"{server} ({hist.total:,})",
        )
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency per sample (s, log scale)")
    ax.set_ylabel("samples")
    ax.set_title("Latency distribution per server")
    ax.legend(loc="upper right", frameon=False)
    return _save(fig, path)


def prompt_vs_output(data: ReportData, path: Path) -> Path:
    fig, ax = _figure()
    points = data.scatter.items
    if not points:
        _empty(ax, "no finished samples yet")
        return _save(fig, path)
    for truncated, color, label in (
        (False, STOP_COLOR, "stopped on its own"),
        (True, TRUNCATED_COLOR, "truncated"),
    ):
        xs = [max(p, 1) for p, _, t in points if t is truncated]
        ys = [max(o, 1) for _, o, t in points if t is truncated]
        if xs:
            ax.scatter(
                xs,
                ys,
                s=12 if truncated else 6,
                alpha=0.6 if truncated else 0.45,
                color=color,
                label=f"{label} ({len(xs):,})",
                zorder=3 if truncated else 2,
            )
    ax.axhline(data.max_new_tokens, color=TRUNCATED_COLOR, linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens, log scale)")
    ax.set_ylabel("output length (tokens, log scale)")
    sample = (
        f"a uniform sample of {len(points):,} of {data.scatter.seen:,}"
        if data.scatter.sampled
        else f"all {len(points):,} samples"
    )
    ax.set_title(f"Prompt vs output length ({sample})")
    ax.legend(loc="lower right", frameon=False)
    return _save(fig, path)
