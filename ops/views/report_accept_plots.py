"""The acceptance figures of `tokenmill report`: acceptance length per group with its intervals,
the accepted-drafts histogram, acceptance against output length, and a paired comparison.

Each takes a computed report (`app.outputs.acceptance`, `app.outputs.accept_pairs`), never items.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from app.outputs.accept_pairs import PairedGroup
from app.outputs.acceptance import GroupStats
from ops.views.report_plots import DPI, SIZE_IN, STOP_COLOR, TRUNCATED_COLOR

BETTER_COLOR = "#2ca02c"
WORSE_COLOR = "#C44E52"
UNCLEAR_COLOR = "#7f7f7f"


def _figure() -> tuple[Figure, Axes]:
    # the report's figure size on an Agg canvas of its own (no pyplot state)
    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _empty(fig: Figure, ax: Axes, message: str, path: Path) -> Path:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, fontsize=13)
    ax.set_axis_off()
    return _save(fig, path)


def _error_bars(groups: Sequence[GroupStats]) -> list[list[float]]:
    return [
        [g.accept_length - g.accept_length_ci[0] for g in groups],
        [g.accept_length_ci[1] - g.accept_length for g in groups],
    ]


def acceptance_by_group(
    groups: Sequence[GroupStats], overall: GroupStats, field: str, path: Path
) -> Path:
    """One bar per value of a field: token-weighted acceptance length with its 95% interval."""
    fig, ax = _figure()
    if not groups:
        return _empty(fig, ax, f"no rows carry '{field}'", path)
    labels = [f"{g.value}\n({g.requests:,} req)" for g in groups]
    ax.bar(labels, [g.accept_length for g in groups], color=STOP_COLOR, alpha=0.85)
    ax.errorbar(
        labels,
        [g.accept_length for g in groups],
        yerr=_error_bars(groups),
        fmt="none",
        ecolor="black",
        capsize=4,
        label="95% bootstrap interval",
    )
    ax.axhline(
        overall.accept_length,
        color=TRUNCATED_COLOR,
        linestyle="--",
        linewidth=1.2,
        label=f"overall {overall.accept_length:.2f}",
    )
    ax.set_ylim(bottom=1.0)
    ax.set_ylabel("acceptance length (tokens per verify step)")
    ax.set_title(f"Acceptance length by {field}")
    ax.legend(loc="upper right", frameon=False)
    return _save(fig, path)


def accepted_histogram(overall: GroupStats, path: Path) -> Path:
    """Verify steps by how many drafts they accepted (SGLang's spec_correct_drafts_histogram)."""
    fig, ax = _figure()
    counts = overall.histogram
    if not counts or not sum(counts):
        return _empty(fig, ax, "no verify steps recorded", path)
    total = sum(counts)
    bars = ax.bar(range(len(counts)), counts, color=STOP_COLOR)
    ax.bar_label(bars, labels=[f"{100 * c / total:.1f}%" for c in counts], padding=3)
    ax.set_xticks(range(len(counts)))
    ax.set_xlabel("drafts accepted in one verify step")
    ax.set_ylabel("verify steps")
    ax.set_ylim(0, max(counts) * 1.15)
    ax.set_title(f"Accepted drafts per verify step ({total:,} steps)")
    return _save(fig, path)


def acceptance_vs_length(groups: Sequence[GroupStats], path: Path) -> Path:
    """Acceptance length per output-length bucket, token-weighted and per-request mean."""
    fig, ax = _figure()
    if not groups:
        return _empty(fig, ax, "no finished samples with counters", path)
    xs = list(range(len(groups)))
    ax.errorbar(
        xs,
        [g.accept_length for g in groups],
        yerr=_error_bars(groups),
        color=STOP_COLOR,
        marker="o",
        capsize=4,
        label="token-weighted (Σ tokens / Σ verify steps)",
    )
    ax.plot(
        xs,
        [g.mean_accept_length for g in groups],
        color=TRUNCATED_COLOR,
        marker="s",
        linestyle=":",
        label="mean per request",
    )
    ax.set_xticks(xs, [f"{g.value}\n({g.requests:,})" for g in groups])
    ax.set_xlabel("output length (tokens; requests)")
    ax.set_ylabel("acceptance length")
    ax.set_title("Acceptance length against output length")
    ax.legend(loc="best", frameon=False)
    return _save(fig, path)


def paired_differences(groups: Sequence[PairedGroup], title: str, path: Path) -> Path:
    """B - A of the acceptance length per group with its 95% interval, colored by verdict."""
    fig, ax = _figure()
    if not groups:
        return _empty(fig, ax, "no pairs with counters on both sides", path)
    colors = {"better": BETTER_COLOR, "worse": WORSE_COLOR}
    ys = list(range(len(groups)))
    for y, g in zip(ys, groups, strict=True):
        ax.errorbar(
            [g.difference],
            [y],
            xerr=[[g.difference - g.difference_ci[0]], [g.difference_ci[1] - g.difference]],
            fmt="o",
            color=colors.get(g.verdict, UNCLEAR_COLOR),
            capsize=4,
        )
    ax.axvline(0, color="black", linewidth=1)
    ax.set_yticks(ys, [f"{g.field}={g.value} ({g.pairs:,})" for g in groups])
    ax.invert_yaxis()
    ax.set_xlabel("acceptance length, B - A (95% interval; green: B better, red: B worse)")
    ax.set_title(title)
    return _save(fig, path)
