"""Acceptance of a speculative draft from a run's stored counters: acceptance length and rate per
group (overall, a metadata field, turn, output length) with seeded bootstrap intervals, and
the paired comparison of two runs on the same prompts.

Pure functions of the rows given: `ops.accept_cmd` reads them from the ledger.
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from app.core.run_kinds import TurnsMode

CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 1000
# resamples drawn at once: bounds the index matrix to chunk x rows
RESAMPLE_CHUNK = 64
# output-length buckets (completion tokens): [edge, next edge)
LENGTH_EDGES = (1, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
TURN_FIELD = "turn"
LENGTH_FIELD = "output_length"
MISSING = "(none)"

PairKey = tuple[str, int, int]


@dataclass(frozen=True)
class AcceptRow:
    """One done item with its speculative counters (verify_ct 0: it had none)."""

    key: str
    sample: int
    turn: int
    metadata: dict[str, Any]
    completion_tokens: int
    verify_ct: int
    correct: int
    proposed: int
    histogram: tuple[int, ...]
    output_digest: str

    @property
    def pair_key(self) -> PairKey:
        return (self.key, self.sample, self.turn)

    @property
    def accept_length(self) -> float:
        return self.completion_tokens / self.verify_ct


def output_digest(output_ids: Sequence[int] | None) -> str:
    return hashlib.sha256(",".join(map(str, output_ids or ())).encode()).hexdigest()[:32]


def length_bucket(tokens: int) -> str:
    """The output-length bucket of a request, e.g. "256-511"."""
    for low, high in itertools.pairwise(LENGTH_EDGES):
        if tokens < high:
            return f"{low}-{high - 1}"
    return f"{LENGTH_EDGES[-1]}+"


def _bucket_order(label: str) -> int:
    return int(label.split("-")[0].rstrip("+"))


def field_value(row: AcceptRow, name: str) -> str:
    """The group a row falls in for a field: a metadata field (a dotted name reads inside an
    object field), its turn, or its length bucket."""
    if name == TURN_FIELD:
        return str(row.turn)
    if name == LENGTH_FIELD:
        return length_bucket(row.completion_tokens)
    value: Any = row.metadata
    for part in name.split("."):  # `metadata.category`: a field inside an object field
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return MISSING
    return value if isinstance(value, str) else str(value)


def _rng(seed: int, label: str) -> np.random.Generator:
    # one stream per group, so a group's interval does not depend on which others are asked for
    return np.random.default_rng([seed, zlib.crc32(label.encode())])


def interval(values: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def bootstrap(
    n: int,
    statistics: Callable[[np.ndarray], np.ndarray],
    *,
    seed: int,
    label: str,
    resamples: int,
) -> np.ndarray:
    """statistics(indices) for `resamples` resamples of range(n) with replacement: an array of
    shape (resamples, k). `statistics` takes a (chunk, n) index matrix, returns (chunk, k)."""
    rng = _rng(seed, label)
    out = []
    left = resamples
    while left > 0:
        size = min(RESAMPLE_CHUNK, left)
        out.append(statistics(rng.integers(0, n, size=(size, n))))
        left -= size
    return np.concatenate(out)


@dataclass
class GroupStats:
    """Acceptance of one group of requests, each estimate with its 95% bootstrap interval."""

    field: str
    value: str
    requests: int
    tokens: int
    verify_steps: int
    accept_length: float
    accept_length_ci: tuple[float, float]
    mean_accept_length: float
    mean_accept_length_ci: tuple[float, float]
    accept_rate: float
    accept_rate_ci: tuple[float, float]
    histogram: list[int]

    def to_json(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "value": self.value,
            "requests": self.requests,
            "tokens": self.tokens,
            "verify_steps": self.verify_steps,
            "accept_length": self.accept_length,
            "accept_length_ci": list(self.accept_length_ci),
            "mean_accept_length": self.mean_accept_length,
            "mean_accept_length_ci": list(self.mean_accept_length_ci),
            "accept_rate": self.accept_rate,
            "accept_rate_ci": list(self.accept_rate_ci),
            "histogram": self.histogram,
        }


STATS_HEADER = (
    "group",
    "requests",
    "tokens",
    "accept length [95% CI]",
    "mean per request [95% CI]",
    "accept rate [95% CI]",
    "accepted drafts per step",
)


def with_interval(value: float, bounds: tuple[float, float], sign: str = "") -> str:
    """`2.654 [2.571, 2.740]`: an estimate and its interval, as the tables print them."""
    return f"{value:{sign}.3f} [{bounds[0]:.3f}, {bounds[1]:.3f}]"


def histogram_text(counts: Sequence[int]) -> str:
    total = sum(counts) or 1
    return " ".join(f"{i}:{100 * n / total:.0f}%" for i, n in enumerate(counts))


def stats_cells(g: GroupStats) -> tuple[str, ...]:
    """A group's row of STATS_HEADER (the terminal table and the report page share it)."""
    return (
        "overall" if g.field == "overall" else f"{g.field}={g.value}",
        f"{g.requests:,}",
        f"{g.tokens:,}",
        with_interval(g.accept_length, g.accept_length_ci),
        with_interval(g.mean_accept_length, g.mean_accept_length_ci),
        with_interval(g.accept_rate, g.accept_rate_ci),
        histogram_text(g.histogram),
    )


def _columns(rows: Sequence[AcceptRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    tokens = np.array([r.completion_tokens for r in rows], dtype=np.float64)
    steps = np.array([r.verify_ct for r in rows], dtype=np.float64)
    correct = np.array([r.correct for r in rows], dtype=np.float64)
    proposed = np.array([r.proposed for r in rows], dtype=np.float64)
    return tokens, steps, correct, proposed


def summed_histogram(rows: Iterable[AcceptRow]) -> list[int]:
    total: list[int] = []
    for row in rows:
        if len(total) < len(row.histogram):
            total.extend([0] * (len(row.histogram) - len(total)))
        for index, steps in enumerate(row.histogram):
            total[index] += steps
    return total


def group_stats(
    name: str, value: str, rows: Sequence[AcceptRow], *, seed: int, resamples: int
) -> GroupStats:
    """Token-weighted acceptance length (Σ tokens / Σ verify steps), the per-request mean, the
    acceptance rate (Σ accepted / Σ proposed drafts) and the summed histogram of the rows, which
    all have counters; intervals resample requests."""
    tokens, steps, correct, proposed = _columns(rows)

    def stats(idx: np.ndarray) -> np.ndarray:
        return np.stack(
            [
                tokens[idx].sum(axis=1) / steps[idx].sum(axis=1),
                (tokens / steps)[idx].mean(axis=1),
                correct[idx].sum(axis=1) / np.maximum(proposed[idx].sum(axis=1), 1),
            ],
            axis=1,
        )

    draws = bootstrap(len(rows), stats, seed=seed, label=f"{name}={value}", resamples=resamples)
    return GroupStats(
        field=name,
        value=value,
        requests=len(rows),
        tokens=int(tokens.sum()),
        verify_steps=int(steps.sum()),
        accept_length=float(tokens.sum() / steps.sum()),
        accept_length_ci=interval(draws[:, 0]),
        mean_accept_length=float((tokens / steps).mean()),
        mean_accept_length_ci=interval(draws[:, 1]),
        accept_rate=float(correct.sum() / max(proposed.sum(), 1)),
        accept_rate_ci=interval(draws[:, 2]),
        histogram=summed_histogram(rows),
    )


def grouped(
    rows: Iterable[Any], name: str, row_of: Callable[[Any], AcceptRow] = lambda r: r
) -> list[tuple[str, list[Any]]]:
    """Rows (or pairs: row_of picks the row that decides) by their value of a field, in order."""
    groups: dict[str, list[Any]] = {}
    for row in rows:
        groups.setdefault(field_value(row_of(row), name), []).append(row)
    if name == LENGTH_FIELD:
        return sorted(groups.items(), key=lambda kv: _bucket_order(kv[0]))
    return sorted(groups.items(), key=lambda kv: (kv[0] == MISSING, kv[0]))


Member = TypeVar("Member")
Summary = TypeVar("Summary")
MemberIn = TypeVar("MemberIn", contravariant=True)
SummaryOut = TypeVar("SummaryOut", covariant=True)


class Summarize(Protocol[MemberIn, SummaryOut]):
    """A group's summary from its members (`group_stats`, `accept_pairs.paired_group`)."""

    def __call__(
        self, name: str, value: str, members: Sequence[MemberIn], /, *, seed: int, resamples: int
    ) -> SummaryOut: ...


def summarized(
    members: Sequence[Member],
    fields: Sequence[str],
    summarize: Summarize[Member, Summary],
    *,
    seed: int,
    resamples: int,
    row_of: Callable[[Any], AcceptRow] = lambda r: r,
) -> tuple[Summary | None, dict[str, list[Summary]]]:
    """The pipeline of both acceptance reports: the summary of all members (None when there
    are none), and of each group of each field's values (row_of picks the row that decides)."""
    if not members:
        return None, {}
    overall = summarize("overall", "all", members, seed=seed, resamples=resamples)
    by = {
        name: [
            summarize(name, value, group, seed=seed, resamples=resamples)
            for value, group in grouped(members, name, row_of)
        ]
        for name in fields
    }
    return overall, by


@dataclass
class AcceptReport:
    """`tokenmill accept RUN`: overall, then each asked field's groups."""

    run: str
    speculative: dict[str, Any] | None
    done: int
    without_stats: int
    overall: GroupStats | None
    by: dict[str, list[GroupStats]] = field(default_factory=dict)
    seed: int = 0
    resamples: int = DEFAULT_RESAMPLES

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "speculative": self.speculative,
            "done": self.done,
            "without_stats": self.without_stats,
            "confidence": CONFIDENCE,
            "seed": self.seed,
            "resamples": self.resamples,
            "overall": None if self.overall is None else self.overall.to_json(),
            "by": {name: [g.to_json() for g in groups] for name, groups in self.by.items()},
        }


def accept_report(
    run: str,
    speculative: dict[str, Any] | None,
    rows: Sequence[AcceptRow],
    fields: Sequence[str],
    *,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
) -> AcceptReport:
    """The acceptance of a run's done rows, overall and per value of each field."""
    with_stats = [r for r in rows if r.verify_ct > 0]
    overall, by = summarized(with_stats, fields, group_stats, seed=seed, resamples=resamples)
    return AcceptReport(
        run=run,
        speculative=speculative,
        done=len(rows),
        without_stats=len(rows) - len(with_stats),
        overall=overall,
        by=by,
        seed=seed,
        resamples=resamples,
    )


def default_fields(rows: Sequence[AcceptRow], turns: TurnsMode) -> list[str]:
    """category and source when the rows carry them, turn for boundary samples, output length."""
    present = {name for row in rows for name in row.metadata}
    fields: list[str] = [name for name in ("category", "source") if name in present]
    if TurnsMode(turns).boundary_samples:
        fields.append(TURN_FIELD)
    fields.append(LENGTH_FIELD)
    return fields
