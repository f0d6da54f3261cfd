"""What `tokenmill run` shows while it works: a table of the run and each server, fitted to the
terminal (names never cut), or in a pipe a line per server state change and one every 10 s.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ops.views.progress import Line
from ops.views.text_table import Column, render

if TYPE_CHECKING:
    from app.ledger import reads
    from workers.engine.runner import ServerView

BAR_WIDTH = 20
LINE_EVERY_S = 10  # in a pipe, the run's counts are printed this often

# The names are never cut; in a narrow terminal the last error folds, then the columns go in
# this order: last error, tok/s, in flight, truncated, the bar, ETA.
COLUMNS = (
    Column("run / server"),
    Column("state", wrap=10),
    Column("progress", drop=5),
    Column("finished", right=True),
    Column("in flight", right=True, drop=3),
    Column("done", right=True),
    Column("failed", right=True),
    Column("truncated", right=True, drop=4),
    Column("tok/s", right=True, drop=2),
    Column("ETA", right=True, drop=6),
    Column("last error", wrap=16, drop=1),
)


PACE_WINDOW_S = 60.0  # the ETA and tok/s follow the pace of the last minute


class Rates:
    """The run's rates as `Pace.rates` reads them."""

    def __init__(
        self, counts: reads.RunCounts, elapsed_s: float, items_per_s: float, tokens_per_s: float
    ):
        self.elapsed_s = elapsed_s
        self.finished = counts.done + counts.failed
        self.tokens_per_s = tokens_per_s
        left = counts.total - self.finished
        if left == 0:
            self.eta = "0s"
        else:
            self.eta = f"{left / items_per_s:,.0f}s" if items_per_s > 0 else "—"


class Pace:
    """The pace of this process's work: what finished, and the tokens it made, over the last
    PACE_WINDOW_S. A run taken up again counts only what finishes now (its earlier items are
    not this pace), and a run slowing to its long answers lengthens its ETA as it slows."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self._seen: deque[tuple[float, int, int]] = deque()  # (time, finished, output tokens)

    def rates(self, counts: reads.RunCounts) -> Rates:
        now = self._clock()
        seen = (now, counts.done + counts.failed, counts.output_tokens)
        self._seen.append(seen)
        while len(self._seen) > 2 and now - self._seen[1][0] >= PACE_WINDOW_S:
            self._seen.popleft()
        then, finished, tokens = self._seen[0]
        span = max(now - then, 1e-6)
        return Rates(
            counts,
            max(now - self.started, 1e-6),
            (seen[1] - finished) / span,
            max(seen[2] - tokens, 0) / span,
        )


def server_state(view: ServerView) -> tuple[str, str]:
    """(what kind of state, how it reads): `("down", "down 12s")`; the kind stays the same while
    only the time in it grows."""
    if view.drift:
        kind, text = "drift", "token drift: no work"
    elif view.refused:
        kind, text = "refused", "fingerprint differs: no work"
    elif view.auth:
        kind, text = "auth", "needs an API key: no work"
    elif view.draining:
        kind, text = "draining", "draining: no new work"
    elif view.down and view.down_for_s is not None:
        kind, text = "down", f"down {view.down_for_s:,.0f}s"
    elif view.down:
        kind, text = "connecting", "connecting"
    elif view.unavailable:
        kind, text = "unavailable", "unavailable"
    else:
        kind, text = "ok", "ok"
    if view.parity_differs:
        kind, text = kind + "+parity", text + " (renders prompts differently)"
    return kind, text


def _error(view: ServerView) -> str:
    error = view.drift or (view.down_error if view.down else view.last_error)
    return (error or "").splitlines()[0] if error else ""


def table(counts: reads.RunCounts, views: Sequence[ServerView], pace: Pace) -> list[str]:
    """The run's row and a row per server, fitted to the terminal."""
    rates = pace.rates(counts)
    filled = int(BAR_WIDTH * rates.finished / counts.total) if counts.total else BAR_WIDTH
    rows = [
        [
            counts.run,
            "running" if not counts.finished else "finished",
            "█" * filled + "░" * (BAR_WIDTH - filled),
            f"{rates.finished}/{counts.total}",
            str(sum(v.inflight for v in views)),
            str(counts.done),
            str(counts.failed),
            str(counts.truncated),
            f"{rates.tokens_per_s:,.0f}",
            rates.eta,
            "",
        ]
    ]
    for view in views:
        rows.append(
            [
                f"  {view.name}",
                server_state(view)[1],
                "",
                "",
                str(view.inflight),
                str(view.done),
                str(view.failed),
                "",
                "",
                "",
                _error(view),
            ]
        )
    lines, _ = render(COLUMNS, rows)
    return lines


def frame(counts: reads.RunCounts, views: Sequence[ServerView], pace: Pace) -> list[Line]:
    """The terminal's frame: the table."""
    return [Line(f"row {i}", text) for i, text in enumerate(table(counts, views, pace))]


def log_lines(counts: reads.RunCounts, views: Sequence[ServerView], pace: Pace) -> list[Line]:
    """A pipe's lines: the run's counts (printed every LINE_EVERY_S) and each server's state
    (printed when it changes)."""
    rates = pace.rates(counts)
    run = Line(
        "run",
        f"{counts.run}: {rates.finished}/{counts.total} finished, {counts.done} done "
        f"({counts.truncated} truncated), {counts.failed} failed, "
        f"{rates.tokens_per_s:,.0f} tok/s, ETA {rates.eta}",
        int(rates.elapsed_s // LINE_EVERY_S),
    )
    lines = [run]
    for view in views:
        kind, text = server_state(view)
        error = _error(view)
        said = f"  {view.name}  {text}" + (f"  last error: {error}" if error else "")
        lines.append(Line(f"server {view.name}", said, (kind, error)))
    return lines
