"""Streaming accumulators behind `tokenmill report`: histograms, time bins, samples, pauses.

Bins are fixed before streaming and the scatter sample is bounded: memory stays flat.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from app.core.models import ItemStatus
from app.ledger import dashboard_queries

SCATTER_POINTS = 20_000
LENGTH_BINS = 60
LATENCY_BINS = 50
MAX_TIME_BINS = 100
NICE_WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600)
UNKNOWN_SERVER = "(none)"
FAILED = "failed"


def log_edges(low: float, high: float, bins: int, *, integers: bool = False) -> list[float]:
    """Log-spaced bin edges from low to high (integer edges for token counts, no empty
    sub-token bins); a degenerate range is widened so there is always one bin."""
    low = max(low, 1.0 if integers else 1e-6)
    high = max(high, low * 2)
    ratio = (high / low) ** (1 / bins)
    edges = [low * ratio**i for i in range(bins + 1)]
    edges[-1] = high
    if integers:
        edges = sorted({float(round(e)) for e in edges})
    return edges


class Histogram:
    """Counts over fixed edges; values outside are clipped into the first or last bin."""

    def __init__(self, edges: Sequence[float]) -> None:
        if len(edges) < 2:
            raise ValueError("a histogram needs at least two edges")
        self.edges = list(edges)
        self.counts = [0] * (len(self.edges) - 1)

    def add(self, value: float) -> None:
        index = bisect_right(self.edges, value) - 1
        self.counts[min(max(index, 0), len(self.counts) - 1)] += 1

    @property
    def total(self) -> int:
        return sum(self.counts)


class Reservoir:
    """A uniform sample of at most `size` items of a stream (Algorithm R), reproducible."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.seen = 0
        self.items: list[tuple[int, int, bool]] = []
        self._rng = random.Random(seed)

    def add(self, item: tuple[int, int, bool]) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
            return
        slot = self._rng.randrange(self.seen)
        if slot < self.size:
            self.items[slot] = item

    @property
    def sampled(self) -> bool:
        return self.seen > len(self.items)


def nice_bin_width_s(span_s: float, max_bins: int = MAX_TIME_BINS) -> float:
    """The smallest round width (1 s, 2 s, 5 s … 6 h, then whole days) giving ≤ max_bins."""
    for width in NICE_WIDTHS_S:
        if span_s / width < max_bins:
            return float(width)
    return 86400.0 * math.ceil(span_s / 86400 / max_bins)


@dataclass
class Throughput:
    """Output tokens finished per server in round time bins from `start` to `start + span_s`;
    the last bin ends with the data (half to one and a half widths long: no sliver bin whose
    few tokens would spike or dip), and its rate uses its real length."""

    start: datetime
    width_s: float
    span_s: float
    tokens: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def spanning(cls, start: datetime, end: datetime) -> Throughput:
        span_s = max((end - start).total_seconds(), 1.0)
        return cls(start=start, width_s=nice_bin_width_s(span_s), span_s=span_s)

    @property
    def bins(self) -> int:
        return max(1, math.floor(self.span_s / self.width_s + 0.5))

    @property
    def end(self) -> datetime:
        return self.start + timedelta(seconds=self.span_s)

    def edges_s(self) -> list[float]:
        """Bin edges in seconds from start."""
        return [i * self.width_s for i in range(self.bins)] + [self.span_s]

    def add(self, server: str, at: datetime, tokens: int) -> None:
        index = int((at - self.start).total_seconds() // self.width_s)
        row = self.tokens.setdefault(server, [0] * self.bins)
        row[min(max(index, 0), self.bins - 1)] += tokens

    def tokens_per_s(self, server: str) -> list[float]:
        edges = self.edges_s()
        row = self.tokens.get(server, [0] * self.bins)
        return [t / (b - a) for t, a, b in zip(row, edges[:-1], edges[1:], strict=True)]


@dataclass(frozen=True)
class PausePeriod:
    """A span a server was paused, clipped to the window; paused_at is when it really began."""

    server: str
    start: datetime
    end: datetime
    open: bool  # still paused when the window ends
    paused_at: datetime


def pause_periods(
    events: Iterable[dashboard_queries.ServerEvent],
    *,
    paused_kind: str,
    resumed_kind: str,
    since: datetime,
    until: datetime,
) -> list[PausePeriod]:
    """Per server, the spans between a pause and the next resume, clipped to [since, until];
    a pause with no resume yet runs to `until`. Events must come oldest first."""
    opened: dict[str, datetime] = {}
    periods: list[PausePeriod] = []
    for event in events:
        if event.kind == paused_kind:
            opened.setdefault(event.server, event.at)  # a re-pause keeps the first start
        elif event.kind == resumed_kind and event.server in opened:
            start = opened.pop(event.server)
            if event.at > since and start < until:
                periods.append(PausePeriod(event.server, max(start, since), event.at, False, start))
    for server, start in opened.items():
        if start < until:
            periods.append(PausePeriod(server, max(start, since), until, True, start))
    periods.sort(key=lambda p: (p.start, p.server))
    return periods


def serving_pauses(
    pauses: Iterable[PausePeriod], servers: Mapping[str, ServerTotals]
) -> list[PausePeriod]:
    """The pauses of the servers that served the run, clipped to the span each served it (its
    first item's start to its last item's end): a server that never took an item of the run,
    or a pause before it joined or after it left, says nothing about the run's throughput."""
    clipped = []
    for p in pauses:
        totals = servers.get(p.server)
        if totals is None or totals.first_at is None or totals.last_at is None:
            continue
        start, end = max(p.start, totals.first_at), min(p.end, totals.last_at)
        if start < end:
            clipped.append(replace(p, start=start, end=end, open=p.open and end == p.end))
    return clipped


@dataclass
class ServerTotals:
    done: int = 0
    truncated: int = 0
    failed: int = 0
    output_tokens: int = 0
    latency_sum_s: float = 0.0
    latency_n: int = 0
    # the span the server served the run: its first item's start, its last item's end
    first_at: datetime | None = None
    last_at: datetime | None = None

    def served(self, started_at: datetime | None, finished_at: datetime | None) -> None:
        """Widen the span by one item's times."""
        for at in (started_at, finished_at):
            if at is not None:
                self.first_at = at if self.first_at is None else min(self.first_at, at)
                self.last_at = at if self.last_at is None else max(self.last_at, at)

    @property
    def mean_latency_s(self) -> float | None:
        return self.latency_sum_s / self.latency_n if self.latency_n else None


@dataclass
class ReportData:
    """Everything the report plots, filled one item at a time."""

    max_new_tokens: int
    stop_lengths: Histogram
    truncated_lengths: Histogram
    latency_edges: list[float]
    throughput: Throughput | None
    finish_reasons: Counter[str] = field(default_factory=Counter)
    latency: dict[str, Histogram] = field(default_factory=dict)
    servers: dict[str, ServerTotals] = field(default_factory=dict)
    scatter: Reservoir = field(default_factory=lambda: Reservoir(SCATTER_POINTS))
    done: int = 0
    truncated: int = 0
    failed: int = 0
    empty_outputs: int = 0
    output_tokens: int = 0
    max_output_tokens: int = 0

    @classmethod
    def for_ranges(
        cls,
        ranges: dashboard_queries.ItemRanges,
        *,
        max_new_tokens: int,
        scatter_points: int = SCATTER_POINTS,
    ) -> ReportData:
        top = max(max_new_tokens, ranges.max_completion_tokens or 0, 2)
        length_edges = log_edges(1, top + 1, LENGTH_BINS, integers=True)
        low = ranges.min_latency_s or 0.01
        high = ranges.max_latency_s or 1.0
        throughput = None
        start = ranges.first_started_at or ranges.first_finished_at
        if start is not None and ranges.last_finished_at is not None:
            throughput = Throughput.spanning(start, ranges.last_finished_at)
        return cls(
            max_new_tokens=max_new_tokens,
            stop_lengths=Histogram(length_edges),
            truncated_lengths=Histogram(length_edges),
            latency_edges=log_edges(low, high * 1.0001, LATENCY_BINS),
            throughput=throughput,
            scatter=Reservoir(scatter_points),
        )

    def add(self, item: dashboard_queries.ItemStats) -> None:
        if item.status not in (ItemStatus.DONE.value, ItemStatus.FAILED.value):
            return
        server = item.server or UNKNOWN_SERVER
        totals = self.servers.setdefault(server, ServerTotals())
        totals.served(item.started_at, item.finished_at)
        if item.status == ItemStatus.FAILED.value:
            self.failed += 1
            totals.failed += 1
            self.finish_reasons[FAILED] += 1
            return
        tokens = item.completion_tokens or 0
        truncated = item.finish_reason == "length"
        self.done += 1
        self.output_tokens += tokens
        self.max_output_tokens = max(self.max_output_tokens, tokens)
        self.finish_reasons[item.finish_reason or "unknown"] += 1
        totals.done += 1
        totals.output_tokens += tokens
        if tokens == 0:
            self.empty_outputs += 1
        if truncated:
            self.truncated += 1
            totals.truncated += 1
            self.truncated_lengths.add(tokens)
        else:
            self.stop_lengths.add(tokens)
        if item.latency_s is not None:
            totals.latency_sum_s += item.latency_s
            totals.latency_n += 1
            self.latency.setdefault(server, Histogram(self.latency_edges)).add(item.latency_s)
        if self.throughput is not None and item.finished_at is not None:
            self.throughput.add(server, item.finished_at, tokens)
        self.scatter.add((item.prompt_tokens, tokens, truncated))

    def output_percentile(self, pct: float) -> float | None:
        """From the scatter sample: exact up to its size, an estimate beyond."""
        return dashboard_queries.percentile([float(out) for _, out, _ in self.scatter.items], pct)


def accumulate(
    stream: Iterable[dashboard_queries.ItemStats],
    ranges: dashboard_queries.ItemRanges,
    *,
    max_new_tokens: int,
) -> ReportData:
    data = ReportData.for_ranges(ranges, max_new_tokens=max_new_tokens)
    for item in stream:
        data.add(item)
    return data
