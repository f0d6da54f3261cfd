"""`tokenmill accept RUN_A RUN_B`: two runs on the same prompts, matched by (key, sample, turn):
the paired difference of acceptance per group with its bootstrap interval, and their outputs.

Greedy speculative decoding is lossless, so a pair whose outputs differ under greedy sampling
is a red flag (a different target, template or server), reported with its keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.outputs.acceptance import (
    DEFAULT_RESAMPLES,
    AcceptRow,
    PairKey,
    bootstrap,
    interval,
    summarized,
    with_interval,
)

# keys of differing outputs listed in the report
DIFFERING_SHOWN = 10
# fewer pairs than this get no verdict: a bootstrap of a handful of pairs says little
MIN_PAIRS = 5

Pair = tuple[AcceptRow, AcceptRow]


@dataclass
class PairedGroup:
    """B minus A over one group of pairs, each difference with its 95% interval."""

    field: str
    value: str
    pairs: int
    tokens_a: int
    tokens_b: int
    accept_length_a: float
    accept_length_b: float
    difference: float
    difference_ci: tuple[float, float]
    mean_difference: float
    mean_difference_ci: tuple[float, float]
    accept_rate_difference: float
    accept_rate_difference_ci: tuple[float, float]

    @property
    def verdict(self) -> str:
        """ "better" / "worse" when the interval of B - A excludes 0, else "unclear" ("too few"
        under MIN_PAIRS pairs)."""
        if self.pairs < MIN_PAIRS:
            return "too few"
        low, high = self.difference_ci
        if low > 0:
            return "better"
        if high < 0:
            return "worse"
        return "unclear"

    def to_json(self) -> dict[str, Any]:
        return {
            "field": self.field,
            "value": self.value,
            "pairs": self.pairs,
            "tokens_a": self.tokens_a,
            "tokens_b": self.tokens_b,
            "accept_length_a": self.accept_length_a,
            "accept_length_b": self.accept_length_b,
            "difference": self.difference,
            "difference_ci": list(self.difference_ci),
            "mean_difference": self.mean_difference,
            "mean_difference_ci": list(self.mean_difference_ci),
            "accept_rate_difference": self.accept_rate_difference,
            "accept_rate_difference_ci": list(self.accept_rate_difference_ci),
            "verdict": self.verdict,
        }


PAIRED_HEADER = ("group", "pairs", "A", "B", "B - A [95% CI]", "mean B - A [95% CI]", "verdict")
VERDICT_TEXT = {"better": "B better", "worse": "B worse"}


def paired_cells(g: PairedGroup) -> tuple[str, ...]:
    """A group's row of PAIRED_HEADER (the terminal table and the comparison page share it)."""
    return (
        "overall" if g.field == "overall" else f"{g.field}={g.value}",
        f"{g.pairs:,}",
        f"{g.accept_length_a:.3f}",
        f"{g.accept_length_b:.3f}",
        with_interval(g.difference, g.difference_ci, "+"),
        with_interval(g.mean_difference, g.mean_difference_ci, "+"),
        VERDICT_TEXT.get(g.verdict, g.verdict),
    )


def paired_group(
    name: str, value: str, pairs: Sequence[Pair], *, seed: int, resamples: int
) -> PairedGroup:
    """B - A of the token-weighted acceptance length, the per-request mean and the rate;
    intervals resample pairs (both runs' rows of a prompt together)."""

    def cols(side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        rows = [p[side] for p in pairs]
        return (
            np.array([r.completion_tokens for r in rows], dtype=np.float64),
            np.array([r.verify_ct for r in rows], dtype=np.float64),
            np.array([r.correct for r in rows], dtype=np.float64),
            np.array([r.proposed for r in rows], dtype=np.float64),
        )

    ta, sa, ca, pa = cols(0)
    tb, sb, cb, pb = cols(1)
    per_request = tb / sb - ta / sa

    def stats(idx: np.ndarray) -> np.ndarray:
        la = ta[idx].sum(axis=1) / sa[idx].sum(axis=1)
        lb = tb[idx].sum(axis=1) / sb[idx].sum(axis=1)
        ra = ca[idx].sum(axis=1) / np.maximum(pa[idx].sum(axis=1), 1)
        rb = cb[idx].sum(axis=1) / np.maximum(pb[idx].sum(axis=1), 1)
        return np.stack([lb - la, per_request[idx].mean(axis=1), rb - ra], axis=1)

    label = f"pairs:{name}={value}"
    draws = bootstrap(len(pairs), stats, seed=seed, label=label, resamples=resamples)
    length_a = float(ta.sum() / sa.sum())
    length_b = float(tb.sum() / sb.sum())
    rate_a = float(ca.sum() / max(pa.sum(), 1))
    rate_b = float(cb.sum() / max(pb.sum(), 1))
    return PairedGroup(
        field=name,
        value=value,
        pairs=len(pairs),
        tokens_a=int(ta.sum()),
        tokens_b=int(tb.sum()),
        accept_length_a=length_a,
        accept_length_b=length_b,
        difference=length_b - length_a,
        difference_ci=interval(draws[:, 0]),
        mean_difference=float(per_request.mean()),
        mean_difference_ci=interval(draws[:, 1]),
        accept_rate_difference=rate_b - rate_a,
        accept_rate_difference_ci=interval(draws[:, 2]),
    )


@dataclass
class OutputCheck:
    """The matched pairs' outputs: how many differ, and whether that is a red flag."""

    compared: int
    differing: int
    greedy: bool
    examples: list[PairKey] = field(default_factory=list)

    @property
    def red_flag(self) -> bool:
        return self.greedy and self.differing > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "differing": self.differing,
            "greedy": self.greedy,
            "red_flag": self.red_flag,
            "examples": [list(k) for k in self.examples],
        }


@dataclass
class PairedReport:
    run_a: str
    run_b: str
    speculative_a: dict[str, Any] | None
    speculative_b: dict[str, Any] | None
    only_a: int
    only_b: int
    without_stats: int
    outputs: OutputCheck
    overall: PairedGroup | None
    by: dict[str, list[PairedGroup]] = field(default_factory=dict)
    seed: int = 0
    resamples: int = DEFAULT_RESAMPLES

    @property
    def better(self) -> str | None:
        """The run with the longer acceptance overall when the interval says so, else None."""
        if self.overall is None or self.overall.verdict not in ("better", "worse"):
            return None
        return self.run_b if self.overall.verdict == "better" else self.run_a

    def worse_groups(self) -> list[PairedGroup]:
        return [g for groups in self.by.values() for g in groups if g.verdict == "worse"]

    def to_json(self) -> dict[str, Any]:
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "speculative_a": self.speculative_a,
            "speculative_b": self.speculative_b,
            "difference_is": "B - A",
            "better": self.better,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "without_stats": self.without_stats,
            "outputs": self.outputs.to_json(),
            "seed": self.seed,
            "resamples": self.resamples,
            "overall": None if self.overall is None else self.overall.to_json(),
            "by": {name: [g.to_json() for g in groups] for name, groups in self.by.items()},
            "worse": [{"field": g.field, "value": g.value} for g in self.worse_groups()],
        }


def compare_outputs(pairs: Sequence[Pair], *, greedy: bool) -> OutputCheck:
    differing = sorted(a.pair_key for a, b in pairs if a.output_digest != b.output_digest)
    return OutputCheck(
        compared=len(pairs),
        differing=len(differing),
        greedy=greedy,
        examples=differing[:DIFFERING_SHOWN],
    )


@dataclass(frozen=True)
class Side:
    """One run of a comparison: its name, speculative settings and done rows."""

    run: str
    speculative: dict[str, Any] | None
    rows: Sequence[AcceptRow]


def paired_report(
    a: Side,
    b: Side,
    fields: Sequence[str],
    *,
    greedy: bool,
    seed: int = 0,
    resamples: int = DEFAULT_RESAMPLES,
) -> PairedReport:
    """Match the runs' rows by (key, sample, turn); groups follow run A's metadata."""
    by_key_b = {r.pair_key: r for r in b.rows}
    keys_a = {r.pair_key for r in a.rows}
    matched = [(r, by_key_b[r.pair_key]) for r in a.rows if r.pair_key in by_key_b]
    with_stats = [(x, y) for x, y in matched if x.verify_ct > 0 and y.verify_ct > 0]
    overall, by = summarized(
        with_stats, fields, paired_group, seed=seed, resamples=resamples, row_of=lambda p: p[0]
    )
    return PairedReport(
        run_a=a.run,
        run_b=b.run,
        speculative_a=a.speculative,
        speculative_b=b.speculative,
        only_a=len(keys_a) - len(matched),
        only_b=len(by_key_b) - len(matched),
        without_stats=len(matched) - len(with_stats),
        outputs=compare_outputs(matched, greedy=greedy),
        overall=overall,
        by=by,
        seed=seed,
        resamples=resamples,
    )
